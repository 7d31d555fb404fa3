"""Files that appear whole or not at all: written to a temporary name beside the target, renamed on success.

Used by the core (``scheduler.trace.write_trace``) and by the commands (``--log-batches``, ``--plot``), so
that a failed or interrupted run never leaves a partly written file behind (an existing file keeps its
old contents). No torch import.
"""
from __future__ import annotations

import os
import secrets
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, TextIO


@contextmanager
def atomic_path(path: str | Path) -> Iterator[str]:
    """A temporary path beside ``path`` (same suffix); renamed onto ``path`` only if the block succeeds."""
    p = Path(path)
    # not created here: the block creates it, so the file gets the usual umask permissions
    tmp = str(p.parent / f".{p.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp{p.suffix}")
    try:
        yield tmp
        os.replace(tmp, p)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


@contextmanager
def atomic_output(path: str | Path) -> Iterator[TextIO]:
    """Open a text file for writing that appears at ``path`` only when the block succeeds."""
    with atomic_path(path) as tmp:
        with open(tmp, "w") as f:
            yield f

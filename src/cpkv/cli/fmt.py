"""Output helpers shared by every command: tables, JSON, progress on stderr."""
from __future__ import annotations

import json
import math
import sys
import time
from typing import Any, Iterable, Sequence


def table(headers: Sequence[str], rows: Iterable[Sequence[Any]], file=None) -> None:
    """Print a left-aligned text table."""
    file = file or sys.stdout
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        widths = [max(w, len(c)) for w, c in zip(widths, row)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths)).rstrip(), file=file)
    print("  ".join("-" * w for w in widths), file=file)
    for row in cells:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip(), file=file)


def _cell(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
    return printable(str(v))


def printable(text: str) -> str:
    """``text`` with control characters escaped (``\\x1b``, ``\\n``): a request id from a trace can never move
    the cursor, clear the screen or break a table's rows."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def finite(obj: Any) -> Any:
    """``obj`` with every NaN / infinite float replaced by None (JSON has no NaN)."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite(v) for v in obj]
    return obj


def emit_json(obj: Any) -> None:
    """Print ``obj`` as strict JSON: a non-finite number is null, never NaN / Infinity."""
    print(json.dumps(finite(obj), indent=2, sort_keys=False, allow_nan=False))


class Progress:
    """Progress of long work on stderr: a live bar on a terminal; otherwise (a log, a pipe) one line
    ``label: done/total (note, N s)`` every ``CPKV_PROGRESS_S`` seconds (default 5; 0: at every update),
    the first only once the work has lasted that long, so that short commands print nothing."""

    def __init__(self, total: int, label: str, enabled: bool | None = None, interval_s: float | None = None) -> None:
        from cpkv import envs

        self.total, self.label, self.done, self.note = max(total, 1), label, 0, ""
        self.tty = sys.stderr.isatty() if enabled is None else enabled
        self.interval_s = envs.get("CPKV_PROGRESS_S") if interval_s is None else interval_s
        self.start = self._last = time.monotonic()
        self._drawn = False
        self._shown = -1  # the count of the last line printed (not on a terminal)

    def update(self, n: int = 1, note: str | None = None) -> None:
        self.set(self.done + n, note)

    def set(self, done: int, note: str | None = None) -> None:
        """``done`` units so far; ``note``: what is happening now (shown beside the count)."""
        self.done = done
        if note is not None:
            self.note = note
        now = time.monotonic()
        if self.tty:
            if now - self._last > 0.1 or self.done >= self.total:
                self._last = now
                frac = min(self.done / self.total, 1.0)
                extra = f" {self.note}" if self.note else ""
                sys.stderr.write(f"\r{self.label} [{'#' * int(30 * frac):<30}] {self.done}/{self.total}{extra}\033[K")
                sys.stderr.flush()
                self._drawn = True
        elif now - self._last >= self.interval_s:
            self._last = now
            self._line(now)

    def _line(self, now: float) -> None:
        note = f"{self.note}, " if self.note else ""
        print(f"{self.label}: {self.done}/{self.total} ({note}{now - self.start:.0f} s)", file=sys.stderr, flush=True)
        self._drawn, self._shown = True, self.done

    def close(self) -> None:
        if self.tty and self._drawn:
            sys.stderr.write("\n")
            sys.stderr.flush()
        elif self._drawn and self.done != self._shown:
            self._line(time.monotonic())

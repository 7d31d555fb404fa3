"""Input and output files: which paths cpkv reads and writes, and files that appear whole or not at all. No
torch import.

The input policy of every file a command reads (``--trace``, ``TRACE``, ``--costs``, every file of a checkpoint
``--model``; README, "Reliability"): a path that is, or whose symlink points to, a directory, a device, a FIFO
or a socket, and a symlink loop, are refused before the file is opened, one ``ConfigError`` naming the option
(:func:`check_inputs`, from ``os.stat``: opening a FIFO would wait for a writer forever, a device may never
end). A missing or unreadable file is left to the reader, which names it. Loaders check the same
(:func:`input_problem`) before they open, for callers that declare no inputs.

The output policy of every file a command writes (``--logits-out``, ``--save-trace``, ``--log-batches``,
``--plot``; README, "Reliability"):

- refused before any work starts, one ``ConfigError`` naming the option (:func:`check_outputs`): an empty
  name; a path that is, or whose symlink points to, a directory, a device, a FIFO or a socket; a symlink
  loop; a path that resolves to an input of the same command (``realpath``, through every symlink, or the
  same inode: a hard link) or to another output; a folder that does not exist or takes no new file; a name
  longer than the folder's file system takes; an existing file that is not writable;
- written to a temporary file beside its destination, flushed to disk and renamed onto it only when the
  block that writes it succeeds (:func:`atomic_path`): an error, Ctrl-C or SIGTERM leave the old file, or
  no file, never a partial or empty one;
- a symlink is kept: the file it points to is the destination (replaced, or created when the link
  dangles), as a shell's ``>`` would write through it;
- a replaced regular file keeps its permission bits (and its owner where allowed); a new file gets
  0666 minus the umask.

Used by the core (``scheduler.trace.write_trace``, ``engine.write_logits``) and by the commands.
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from contextlib import contextmanager
from pathlib import Path
from typing import Iterable, Iterator, Mapping, TextIO, Union

from cpkv.errors import ConfigError

Paths = Union[str, Path, Iterable[Union[str, Path]], None]
_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket"))
_TMP_NAME_BYTES = 96  # the part of the destination's name a temporary name repeats (the whole stays short)


def destination(path: str | Path) -> Path:
    """The file a write to ``path`` replaces: ``path`` with every symlink resolved (a dangling link's target).
    Raises ConfigError for a symlink loop."""
    try:
        return Path(os.path.realpath(path, strict=True))
    except FileNotFoundError:
        return Path(os.path.realpath(path))
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise ConfigError(f"{str(path)!r} is a symlink loop (the links point at each other, never at a file)") \
                from None
        return Path(os.path.realpath(path))


def absent(path: str | Path) -> str:
    """Why a folder does not hold ``path`` as a readable file, as a verb phrase for "<folder> ...":
    'lacks', 'holds only as a symlink loop', 'holds only as a dangling symlink (to ...)', 'holds as a directory'."""
    if os.path.islink(path):
        try:
            destination(path)
        except ConfigError:
            return "holds only as a symlink loop"
        if not os.path.exists(path):
            return f"holds only as a dangling symlink (to {os.readlink(path)!r})"
    try:
        st = os.stat(path)
    except OSError:
        return "lacks"
    return f"holds as {kind(st)}, not a file" if kind(st) else "holds, but cannot read it"


def kind(st: os.stat_result) -> str | None:
    """'a directory', 'a FIFO', ... for anything but a regular file; None for a regular file."""
    return next((what for test, what in _KINDS if test(st.st_mode)), None)


def _named(path: str | Path, expected: str) -> tuple[str | None, Path, str]:
    """(why the name itself is refused: empty, or a symlink loop; else None, where it leads, " (the symlink points
    to ...)" when it is a symlink)."""
    if str(path) == "":
        return "expected a file name, got an empty string", Path(), ""
    try:
        dest = destination(path)
    except ConfigError:
        return f"expected {expected}, got a symlink loop (the links point at each other, never at a file)", Path(), ""
    return None, dest, f" (the symlink points to {str(dest)!r})" if os.path.islink(path) else ""


def input_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot be read as an input file (what was expected, what is there), or None when it is a
    regular file or does not exist (the reader names a missing file). Never opens it."""
    problem, _, via = _named(path, "a file")
    if problem:
        return problem
    try:
        st = os.stat(path)
    except OSError:
        return None  # missing, or not reachable: the reader's open names it
    if kind(st):
        return f"expected a regular file, got {kind(st)}{via}: cpkv reads only regular files"
    return None


def check_inputs(inputs: Mapping[str, Paths]) -> None:
    """Raise ConfigError (naming the option) unless every input path (option -> path or paths, None: not given)
    is a regular file or absent, under the input policy above."""
    for option, paths in inputs.items():
        for p in _each(paths):
            problem = input_problem(p)
            if problem:
                raise ConfigError(f"{option} {p!r}: {problem}")


def output_problem(path: str | Path) -> str | None:
    """Why ``path`` cannot take an output file (what was expected, what is there), or None when it can."""
    problem, dest, via = _named(path, "a file name")
    if problem:
        return problem
    long = _name_problem(dest)
    if long:
        return long
    try:
        st = os.stat(dest)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        return f"cannot look at it ({exc.strerror})"
    if st is not None and kind(st):
        return f"expected a regular file name, got {kind(st)}{via}: cpkv never writes onto one"
    if st is not None and not os.access(dest, os.W_OK):
        return f"the file exists and is read-only{via}"
    return _folder_problem(dest)


def _name_problem(dest: Path) -> str | None:
    try:
        limit = os.pathconf(dest.parent if dest.parent.is_dir() else "/", "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    if len(os.fsencode(dest.name)) > limit:
        return f"the file name is {len(os.fsencode(dest.name))} bytes, the file system takes at most {limit}"
    return None


def _folder_problem(dest: Path) -> str | None:
    parent = dest.parent
    if not parent.is_dir():
        return f"the folder {str(parent)!r} does not exist"
    probe = parent / f".cpkv-{secrets.token_hex(6)}.probe"  # a short name: any name the folder takes is tried
    try:
        probe.open("x").close()
        probe.unlink()
    except OSError as exc:
        return f"cannot create a file in {str(parent)!r} ({exc.strerror})"
    return None


def _identities(path: str | Path) -> set:
    """Keys under which two paths are one file: the resolved path and, when it exists, (device, inode)."""
    try:
        keys: set = {str(destination(path))}
    except ConfigError:
        return {os.path.abspath(path)}
    try:
        st = os.stat(path)
        keys.add((st.st_dev, st.st_ino))
    except OSError:
        pass
    return keys


def _each(paths: Paths) -> list[str]:
    if paths is None:
        return []
    if isinstance(paths, (str, Path)):
        return [str(paths)]
    return [str(p) for p in paths if p is not None]


def check_outputs(outputs: Mapping[str, str | Path | None], inputs: Mapping[str, Paths] = {}) -> None:
    """Raise ConfigError (naming the option) unless every input (label -> path or paths) is readable under the
    input policy (:func:`check_inputs`), every output path (option -> path, None: not asked for) can take a file
    under the output policy, and no output is an input or another output."""
    check_inputs(inputs)
    seen: dict = {}  # identity -> (what, whether it is an output)
    for label, paths in inputs.items():
        many = len(_each(paths)) > 1
        for p in _each(paths):
            for key in _identities(p):
                seen.setdefault(key, (f"{label} ({os.path.basename(p)!r})" if many else label, False))
    for option, path in outputs.items():
        if path is None:
            continue
        problem = output_problem(path)
        if problem:
            raise ConfigError(f"{option} {str(path)!r}: {problem}")
        keys = _identities(path)
        clash = next((seen[k] for k in keys if k in seen), None)
        if clash is not None:
            why = "each output needs its own file" if clash[1] else \
                "an input of this command: an output never replaces an input"
            raise ConfigError(f"{option} {str(path)!r} names the same file as {clash[0]}, {why}")
        seen.update({k: (option, True) for k in keys})


def check_output(path: str | Path | None, option: str) -> None:
    """:func:`check_outputs` for one output and no inputs."""
    check_outputs({option: path})


def _umask() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _temp_name(dest: Path) -> Path:
    """A fresh name beside ``dest``, short whatever ``dest``'s length (a long name must stay writable)."""
    head = os.fsencode(dest.name)[:_TMP_NAME_BYTES].decode(errors="ignore")
    suffix = dest.suffix if len(dest.suffix) <= 16 else ""
    return dest.parent / f".{head}.{secrets.token_hex(4)}.tmp{suffix}"


def _commit(tmp: Path, dest: Path) -> None:
    """Flush ``tmp`` to disk, give it ``dest``'s permissions (or the umask's), rename it onto ``dest``."""
    st = os.stat(tmp)  # the block must have written it
    if kind(st):
        raise ConfigError(f"{str(tmp)!r}: expected the written file, got {kind(st)}")
    fd = os.open(tmp, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    try:
        old = os.stat(dest)
    except FileNotFoundError:
        old = None
    if old is not None and kind(old):  # it changed since the command checked it
        raise ConfigError(f"{str(dest)!r}: expected a regular file, got {kind(old)}: cpkv never writes onto one")
    os.chmod(tmp, stat.S_IMODE(old.st_mode) if old is not None else 0o666 & ~_umask())
    if old is not None and (old.st_uid, old.st_gid) != (st.st_uid, st.st_gid):
        try:
            os.chown(tmp, old.st_uid, old.st_gid)
        except OSError:
            pass
    os.replace(tmp, dest)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[str]:
    """A temporary path beside ``path``'s destination (same suffix), for the block to create and write;
    renamed onto the destination (:func:`destination`: through a symlink) only if the block succeeds."""
    dest = destination(path)
    tmp = _temp_name(dest)
    try:
        yield str(tmp)
        _commit(tmp, dest)
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


def string_keys(ids: Iterable[object], what: str) -> list[str]:
    """``str(id)`` of each id, in order; ConfigError naming both ids when two become one key (``1`` and ``"1"``)."""
    keys: dict[str, object] = {}
    for i in ids:
        key = str(i)
        if key in keys:
            raise ConfigError(f"{what}: request ids {keys[key]!r} and {i!r} both become the key {key!r}; give the "
                              "requests ids that differ as text")
        keys[key] = i
    return list(keys)

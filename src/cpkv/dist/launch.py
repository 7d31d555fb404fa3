"""Launch N rank processes in one process group; results come back to the parent in rank order.

Transports (chosen by :func:`pick_backend`):

    device "cpu"                              -> gloo, every rank on the CPU
    device "cuda", >= world_size GPUs visible -> nccl, rank r on cuda:r
    device "cuda", fewer GPUs                 -> gloo with CUDA tensors, every rank on cuda:0
                                                 (NCCL refuses two ranks on one device)

Rendezvous: the parent hosts a ``TCPStore`` on a free port (``CPKV_MASTER_PORT`` if set, else port 0
and the OS picks), children connect to it, so no port is ever raced for.

Every socket the ranks listen on is on loopback: they all run on this host, and nothing else may reach them
(the store takes unauthenticated reads and writes). torch's ``TCPStore`` listens on every interface whatever
host it is given, so the parent binds the listening socket itself on ``127.0.0.1`` and hands it over
(``master_listen_fd``); gloo's and NCCL's own listeners follow ``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``,
which each child sets to the loopback interface before it joins the group.

Each child talks to the parent through its own pipe: a heartbeat every ``BEAT_S`` seconds (from a thread,
so it keeps beating while the rank waits in a collective), progress reports (``ctx.report(...)``) and at
the end ``(ok, payload)``. The parent watches the pipes and the processes:

- a rank that cannot start is one ``RankFailure`` (the first cause; the clean-up never joins a process
  that never started); a rank killed by a signal is named with it ("was killed by SIGSEGV");
- a rank that raises, dies, is stopped (SIGSTOP, state ``T`` in ``/proc``) or stops beating for
  ``heartbeat_s`` once it started beating is a failure; the others get ``grace_s`` seconds (they may be raising their own error,
  e.g. ``ComposeTimeout``) and are then ended;
- ``launch`` raises ``RankFailure`` naming the ranks: dead and stopped ones first (the cause; their peers'
  errors follow from them), then those that raised, in the order they did, then the late ones.
  ``exc.results`` (per rank, None where missing), ``exc.errors`` (rank -> exception, when it could be
  pickled) and ``exc.tracebacks`` carry the details; ``str(exc)`` is one line per rank, no traceback;
- when the parent is interrupted (Ctrl-C, or SIGTERM/SIGHUP turned into an exception by the command
  line), every rank is sent SIGTERM at once and SIGKILL ``STOP_S`` seconds later;
- a child asks the kernel to kill it when the parent dies (Linux ``PR_SET_PDEATHSIG``): no orphan ranks
  even after ``kill -9`` of the parent.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import pickle
import signal
import socket
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing import connection
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from cpkv import envs
from cpkv.errors import ConfigError, RankFailure

HOST = "127.0.0.1"
BEAT_S = 0.25        # a child's heartbeat period
STOP_S = 0.5         # SIGTERM -> SIGKILL delay when ranks are ended early


class _Channel:
    """A child's end of its pipe to the parent; the heartbeat thread and the rank share it."""

    def __init__(self, conn: connection.Connection) -> None:
        self.conn, self.lock = conn, threading.Lock()

    def send(self, msg: tuple) -> None:
        with self.lock:
            self.conn.send(msg)

    def beat_forever(self) -> None:
        while True:
            time.sleep(BEAT_S)
            try:
                self.send(("beat",))
            except (OSError, ValueError):  # the parent went away or the pipe closed: nothing to beat for
                return


@dataclass(frozen=True)
class RankContext:
    """One rank's view of the group. ``shared_device``: several ranks of this group use one device."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    group: Any = None
    shared_device: bool = False
    channel: Any = None  # the pipe to the launching parent (None under torchrun)
    inbox: Any = None    # a long-lived group's queue from the parent (``RankGroup.send``); None otherwise

    def barrier(self) -> None:
        dist.barrier(group=self.group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_reduce_min(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.collective_device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())

    def all_reduce_max_list(self, values: Sequence[int]) -> list[int]:
        """Element-wise max of an int64 list over the ranks (same length on every rank)."""
        if not values:
            return []
        t = torch.tensor(list(values), dtype=torch.int64, device=self.collective_device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return [int(x) for x in t.tolist()]

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """``obj`` of rank ``src`` on every rank (pickled)."""
        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def report(self, payload: Any) -> None:
        """Send a progress report (picklable, small) to the parent's ``on_progress``; no-op under torchrun."""
        if self.channel is not None:
            self.channel.send(("progress", payload))

    @property
    def collective_device(self) -> torch.device:
        """Where small control tensors must live for this backend (NCCL: the GPU; gloo: the CPU)."""
        return self.device if self.backend == "nccl" else torch.device("cpu")


def pick_backend(device: str, world_size: int) -> tuple[str, bool]:
    """(backend, shared_device) for ``world_size`` ranks on ``device`` ("cpu" or "cuda")."""
    if device == "cpu":
        return "gloo", False
    if device == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("device 'cuda' asked for, but torch sees no CUDA device")
        if torch.cuda.device_count() >= world_size:
            return "nccl", False
        return "gloo", True
    raise ConfigError(f"device must be 'cpu' or 'cuda', got {device!r}")


def _rank_device(device: str, rank: int, shared: bool) -> torch.device:
    if device == "cpu":
        return torch.device("cpu")
    return torch.device("cuda", 0 if shared else rank)


def _die_with_parent(parent: int) -> None:
    """Ask the kernel to SIGKILL this process when its parent dies (Linux); exit now if it already has."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


ALLOC_CONF = "expandable_segments:True"  # a cp-1 CUDA rank's allocator unless PYTORCH_CUDA_ALLOC_CONF is set


def default_alloc_conf(device: str, world_size: int) -> None:
    """A lone CUDA rank (cp 1) runs torch's allocator with expandable segments unless ``PYTORCH_CUDA_ALLOC_CONF``
    is set (even to ''): a long forward's transients of varied shapes then extend and reuse mapped memory instead
    of leaving cached blocks of old shapes, so the reserved peak stays near the allocated one (docs/design.md §10).
    Not at cp > 1: there the pools and staging go to peers as CUDA IPC handles, which an expandable segment
    exports only where the container allows ``pidfd_getfd``. Call before the process's first CUDA allocation."""
    if device == "cuda" and world_size == 1:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOC_CONF)


def _child(fn: Callable, rank: int, world_size: int, device: str, backend: str, shared: bool, port: int,
           args: tuple, conn: connection.Connection, timeout_s: float, parent: int, inbox: Any = None) -> None:
    _die_with_parent(parent)
    signal.signal(signal.SIGTERM, lambda *_: _exit(128 + signal.SIGTERM))  # atexit handlers remove shm files
    if inbox is not None:  # a long-lived group: signals to the parent's process group (Ctrl-C, ``timeout``) reach
        os.setpgrp()       # the parent alone, which drains and then ends the ranks itself
    default_alloc_conf(device, world_size)
    channel = _Channel(conn)
    threading.Thread(target=channel.beat_forever, name="cpkv-heartbeat", daemon=True).start()
    dev = _rank_device(device, rank, shared)
    try:
        if dev.type == "cuda":
            torch.cuda.set_device(dev)
        _listen_on_loopback()
        store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        ctx = RankContext(rank, world_size, dev, backend, dist.group.WORLD, shared, channel, inbox)
        result = fn(ctx, *args)
        channel.send(("result", True, result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        try:
            channel.send(("result", False, _failure_payload(exc)))
        finally:
            _exit(1)
    try:
        dist.barrier()  # nobody tears down memory a peer may still read
        dist.destroy_process_group()
    finally:
        _exit(0)


def _exit(code: int) -> None:
    """Run atexit handlers (they remove shared-memory files), then exit without interpreter teardown
    (a dead peer must not make process-group destructors hang)."""
    try:
        atexit._run_exitfuncs()
    finally:
        os._exit(code)


def _failure_payload(exc: BaseException) -> tuple[str, str, str, bytes | None]:
    try:
        blob = pickle.dumps(exc)
    except Exception:  # noqa: BLE001
        blob = None
    return type(exc).__name__, str(exc), traceback.format_exc(), blob


def _free_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """The rendezvous store, listening on ``HOST`` only (torch's own bind would take every interface)."""
    port = envs.get("CPKV_MASTER_PORT")
    sock = _loopback_listener(port)
    try:
        store = dist.TCPStore(HOST, sock.getsockname()[1], world_size + 1, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.fileno(), use_libuv=True)
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now (and closes it when it ends)
    return store


def _loopback_listener(port: int) -> socket.socket:
    """A TCP socket listening on ``HOST``:``port`` (0: a free port); ConfigError when the port is taken."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, port))
        sock.listen(1024)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"CPKV_MASTER_PORT={port}: cannot listen on {HOST}:{port} ({exc.strerror}); another run "
                          "may hold it: pick another port or unset CPKV_MASTER_PORT (a free one is picked)") from None
    return sock


LOOPBACK_IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def _listen_on_loopback() -> None:
    """Make gloo and NCCL bind their listening sockets to the loopback interface (this process only: the ranks
    of one group all run on this host)."""
    name = loopback_ifname()
    if name is not None:
        for var in LOOPBACK_IFNAME_VARS:
            os.environ[var] = name


def loopback_ifname() -> str | None:
    """The loopback interface's name ('lo' on Linux, 'lo0' on macOS), None where none is listed."""
    try:
        names = [n for _, n in socket.if_nameindex()]
    except OSError:
        return None
    loop = [n for n in names if n in ("lo", "lo0")] or [n for n in names if n.startswith("lo")]
    return loop[0] if loop else None


def launch(fn: Callable[..., Any], world_size: int, *, device: str = "cpu", args: Sequence[Any] = (),
           timeout_s: float = 600.0, grace_s: float = 2.0, backend: str | None = None,
           heartbeat_s: float = 30.0, on_progress: Callable[[int, Any], None] | None = None) -> list[Any]:
    """Run ``fn(ctx, *args)`` in ``world_size`` fresh processes; return their results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function). ``timeout_s`` bounds the whole run
    and the process group's collectives; ``grace_s`` is how long the other ranks may still run after a
    first rank failed; a rank silent for ``heartbeat_s`` seconds is failed. ``on_progress(rank, payload)``
    receives every ``ctx.report(payload)``. Raises ``RankFailure`` naming the ranks that raised, died, were
    stopped or did not finish.
    """
    spawned = _Spawned(fn, world_size, device, args, timeout_s, backend, inboxes=False)
    watch = _Watch(spawned.procs, spawned.conns, timeout_s, grace_s, heartbeat_s, on_progress)
    try:
        spawned.start()
        watch.run()
    finally:  # also on an interrupt: no rank outlives the launch, no segment outlives its rank
        spawned.end(early=len(watch.results) < world_size)
    return _finish(watch, world_size, timeout_s)


STOP_SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP", "SIGINT") if hasattr(signal, n))


@contextmanager
def stops_deferred():
    """Inside, SIGTERM / SIGHUP / SIGINT are recorded instead of handled; on exit the handlers that were there
    come back and each recorded signal is raised again (so a stop lands between two rank starts, never in the
    middle of writing a spawned child's bootstrap data). Off the main thread (no handlers there): nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    seen: list[int] = []
    saved = {sig: signal.signal(sig, lambda s, _f: seen.append(s)) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
        for sig in dict.fromkeys(seen):
            signal.raise_signal(sig)


class _Spawned:
    """The rank processes of one launch, their pipes to the parent and (long-lived groups) their inboxes."""

    def __init__(self, fn: Callable, world_size: int, device: str, args: Sequence[Any], timeout_s: float,
                 backend: str | None, inboxes: bool) -> None:
        if not isinstance(world_size, int) or world_size < 1:
            raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
        chosen, self.shared = pick_backend(device, world_size)
        self.fn, self.world_size, self.device, self.args = fn, world_size, device, tuple(args)
        self.backend, self.timeout_s = backend or chosen, timeout_s
        self.store = _free_store(world_size, timeout_s)
        self.mp = mp.get_context("spawn")
        self.inboxes = [self.mp.Queue() for _ in range(world_size)] if inboxes else [None] * world_size
        self.procs: list = []
        self.conns: list = []

    def start(self) -> None:
        for rank in range(self.world_size):
            recv, send = self.mp.Pipe(duplex=False)
            self.conns.append(recv)
            p = self.mp.Process(target=_child, name=f"cpkv-rank{rank}", args=(
                self.fn, rank, self.world_size, self.device, self.backend, self.shared, self.store.port, self.args,
                send, self.timeout_s, os.getpid(), self.inboxes[rank]))
            with stops_deferred():  # a stop mid-start would cut the child's bootstrap data (its EOFError traceback)
                try:
                    p.start()
                except (OSError, pickle.PicklingError, TypeError, AttributeError) as exc:  # fork/spawn or pickling
                    raise RankFailure(f"rank {rank} could not start: {type(exc).__name__}: {exc}") from exc
                finally:
                    send.close()
                self.procs.append(p)  # only started processes: the clean-up never joins one that never ran

    def end(self, early: bool) -> None:
        _end(self.procs, early=early)
        _remove_segments(os.getpid())
        for c in self.conns:
            c.close()
        for q in self.inboxes:
            if q is not None:
                q.cancel_join_thread()  # a rank that died never reads what is left: do not wait on it
                q.close()
        self.store = None


class RankGroup:
    """Long-lived rank processes (``cpkv serve``): started once, fed through per-rank inboxes, watched by a
    thread until they return or one fails.

        group = RankGroup(fn, 2, device="cpu", args=(...,), on_message=f, on_exit=g)
        group.start()                  # ranks run fn(ctx, *args); ctx.inbox is their queue
        group.send(0, msg)             # never blocks (the queue's feeder thread writes the pipe)
        results = group.join(30.0)     # after a message that makes every fn return; RankFailure otherwise

    ``on_message(rank, payload)`` gets every ``ctx.report(payload)`` (on the watch thread). ``on_exit(exc)``
    is called once, on the watch thread, when the group is over: ``exc`` is None when every rank returned,
    else the ``RankFailure`` naming the ranks (as ``launch`` raises it; the other ranks are ended first).
    ``timeout_s`` bounds each collective (not the group's life); ranks run in their own process group, so
    a signal to the parent's group (Ctrl-C) reaches only the parent, which ends them.
    """

    def __init__(self, fn: Callable[..., Any], world_size: int, *, device: str = "cpu", args: Sequence[Any] = (),
                 timeout_s: float = 600.0, grace_s: float = 2.0, heartbeat_s: float = 30.0,
                 on_message: Callable[[int, Any], None] | None = None,
                 on_exit: Callable[[RankFailure | None], None] | None = None) -> None:
        self.spawned = _Spawned(fn, world_size, device, args, timeout_s, None, inboxes=True)
        self.watch = _Watch(self.spawned.procs, self.spawned.conns, float("inf"), grace_s, heartbeat_s, on_message)
        self.on_exit = on_exit
        self.results: list[Any] | None = None
        self.failure: RankFailure | None = None
        self._thread = threading.Thread(target=self._watch, name="cpkv-rank-watch", daemon=True)

    @property
    def pids(self) -> list[int | None]:
        return [p.pid for p in self.spawned.procs]

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def start(self) -> None:
        try:
            self.spawned.start()
        except BaseException:
            self.spawned.end(early=True)
            raise
        self._thread.start()

    def send(self, rank: int, msg: Any) -> None:
        self.spawned.inboxes[rank].put(msg)

    def _watch(self) -> None:
        exc: RankFailure | None = None
        try:
            self.watch.run()
        finally:
            self.spawned.end(early=len(self.watch.results) < self.spawned.world_size)
            try:
                self.results = _finish(self.watch, self.spawned.world_size, float("inf"))
            except RankFailure as e:
                self.failure = exc = e
            if self.on_exit is not None:
                self.on_exit(exc)

    def join(self, timeout_s: float) -> list[Any]:
        """Wait ``timeout_s`` for every rank to return (after a message that ends ``fn``), else end them all.
        Returns the results; raises the group's RankFailure."""
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            self.stop()
        if self.failure is not None:
            raise self.failure
        return self.results or []

    def stop(self) -> None:
        """End every rank now (SIGTERM, SIGKILL ``STOP_S`` later) and wait for the watch thread."""
        _end(self.spawned.procs, early=True)
        self._thread.join(STOP_S + 5.0)


class _Watch:
    """The parent's loop over the children's pipes and processes (see the module docstring)."""

    def __init__(self, procs: list, conns: list, timeout_s: float, grace_s: float, heartbeat_s: float,
                 on_progress: Callable[[int, Any], None] | None) -> None:
        self.procs, self.conns, self.on_progress = procs, conns, on_progress
        self.timeout_s, self.grace_s, self.heartbeat_s = timeout_s, grace_s, heartbeat_s
        self.results: dict[int, Any] = {}
        self.failures: dict[int, tuple] = {}  # rank -> (order, kind, detail); kind: raised / dead / stopped
        self.seen: dict[int, float] = {}      # rank -> when the parent last heard from it (from its first beat:
        #                                       starting up, importing torch, may take long on a loaded host)
        self.stopped_since: dict[int, float] = {}

    def settled(self, rank: int) -> bool:
        return rank in self.results or rank in self.failures

    def run(self) -> None:
        start = last = time.monotonic()
        deadline = start + self.timeout_s
        while not all(self.settled(r) for r in range(len(self.procs))):
            now = time.monotonic()
            if now >= deadline:
                return
            if now - last > 1.0:  # this process was not running (stopped itself, or starved): no one is late
                self.seen = {r: max(t, now) for r, t in self.seen.items()}
            last = now
            ready = connection.wait(self._waitables(), timeout=min(deadline - now, BEAT_S))
            self._read(ready)
            self._check_alive()
            if self.failures:
                deadline = min(deadline, self._first_failure_s + self.grace_s)

    def _waitables(self) -> list:
        out = [c for r, c in enumerate(self.conns) if not self.settled(r)]
        return out + [p.sentinel for r, p in enumerate(self.procs) if not self.settled(r)]

    def _read(self, ready: list) -> None:
        for rank, conn in enumerate(self.conns):
            if self.settled(rank):
                continue
            if conn in ready or self.procs[rank].sentinel in ready:
                self._drain(rank, conn)
            if not self.settled(rank) and self.procs[rank].sentinel in ready:
                self.procs[rank].join(1.0)
                self._fail(rank, "dead", self.procs[rank].exitcode)

    def _drain(self, rank: int, conn: connection.Connection) -> None:
        try:
            while not self.settled(rank) and conn.poll():
                msg = conn.recv()
                self.seen[rank] = time.monotonic()
                if msg[0] == "progress" and self.on_progress is not None:
                    self.on_progress(rank, msg[1])
                elif msg[0] == "result":
                    if msg[1]:
                        self.results[rank] = msg[2]
                    else:
                        self._fail(rank, "raised", msg[2])
        except (EOFError, OSError):
            pass

    def _check_alive(self) -> None:
        now = time.monotonic()
        for rank, p in enumerate(self.procs):
            if self.settled(rank):
                continue
            if _state(p.pid) in ("T", "t"):
                since = self.stopped_since.setdefault(rank, now)
                if now - since >= 2 * BEAT_S:
                    self._fail(rank, "stopped", "its process is stopped (SIGSTOP or a debugger)")
                continue
            self.stopped_since.pop(rank, None)
            if rank in self.seen and now - self.seen[rank] > self.heartbeat_s:
                self._fail(rank, "stopped", f"no heartbeat for {now - self.seen[rank]:.1f} s (hung or starved)")

    def _fail(self, rank: int, kind: str, detail: Any) -> None:
        if not self.failures:
            self._first_failure_s = time.monotonic()
        self.failures[rank] = (len(self.failures), kind, detail)


def _state(pid: int | None) -> str:
    """The process state letter of /proc/PID/stat ('R', 'S', 'T' stopped, ...); '' where unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return ""


def _end(procs: list, early: bool) -> None:
    """End the rank processes. ``early``: they are not done (a failure or an interrupt): SIGTERM every one
    at once, SIGKILL what is left ``STOP_S`` later. Otherwise they are leaving on their own."""
    deadline = time.monotonic() + (STOP_S if early else 5.0)
    if early:
        for p in procs:
            if p.is_alive():
                p.terminate()
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def _remove_segments(parent: int) -> None:
    """Remove the /dev/shm segments of this parent's rank groups (``compose.peer.segment_token`` names them
    ``cpkv-<parent>x...``): a rank killed by a signal runs no clean-up of its own."""
    import glob

    for path in glob.glob(f"/dev/shm/cpkv-{parent}x*"):
        try:
            os.unlink(path)
        except OSError:
            pass


def _finish(watch: _Watch, world_size: int, timeout_s: float) -> list[Any]:
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException | None] = {}
    tracebacks: dict[int, str] = {}
    lines: list[tuple[tuple, str]] = []
    for rank in range(world_size):
        if rank in watch.results:
            results[rank] = watch.results[rank]
            continue
        errors[rank] = None
        if rank not in watch.failures:
            limit = f"the run's {timeout_s:g} s limit" if timeout_s != float("inf") else "a stop"
            lines.append(((2, rank), f"rank {rank} did not finish (ended after {limit} or a peer's failure)"))
            continue
        order, kind, detail = watch.failures[rank]
        if kind == "dead":
            lines.append(((0, order), f"rank {rank} {death(detail)} before returning"))
        elif kind == "stopped":
            lines.append(((0, order), f"rank {rank} stopped responding: {detail}"))
        else:
            name, msg, tb, blob = detail
            first = msg.strip().splitlines()[0] if msg.strip() else ""
            lines.append(((1, order), f"rank {rank} raised {name}: {first}"))
            errors[rank], tracebacks[rank] = _unpickle(blob), tb
    if lines:
        lines.sort()
        exc = RankFailure("; ".join(text for _, text in lines))
        exc.results, exc.errors, exc.tracebacks = results, errors, tracebacks  # type: ignore[attr-defined]
        exc.failed = sorted(errors)  # type: ignore[attr-defined]
        exc.first = int(lines[0][1].split()[1])  # type: ignore[attr-defined]
        raise exc
    return results


def death(exitcode: int | None) -> str:
    """How a process ended, from its exit code: 'was killed by SIGSEGV', 'died with exit code 3'."""
    if exitcode is not None and exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"died with exit code {exitcode}" if exitcode is not None else "died (exit code unknown)"


def _unpickle(blob: bytes | None) -> BaseException | None:
    try:
        return pickle.loads(blob) if blob else None
    except Exception:  # noqa: BLE001
        return None


def context_from_env(device: str = "cpu", timeout_s: float = 600.0) -> RankContext:
    """This process's RankContext under torchrun: env:// rendezvous (RANK, WORLD_SIZE, LOCAL_RANK)."""
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    except KeyError as exc:
        raise ConfigError(f"context_from_env needs torchrun's {exc.args[0]} environment variable") from None
    local = int(os.environ.get("LOCAL_RANK", rank))
    backend, shared = pick_backend(device, world)
    dev = torch.device("cpu") if device == "cpu" else torch.device("cuda", 0 if shared else local)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", rank=rank, world_size=world,
                                timeout=timedelta(seconds=timeout_s))
    return RankContext(rank, world, dev, backend, dist.group.WORLD, shared)

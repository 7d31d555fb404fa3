"""Launch N rank processes in one process group; results come back to the parent in rank order.

Transports (chosen by :func:`pick_backend`):

    device "cpu"                              -> gloo, every rank on the CPU
    device "cuda", >= world_size GPUs visible -> nccl, rank r on cuda:r
    device "cuda", fewer GPUs                 -> gloo with CUDA tensors, every rank on cuda:0
                                                 (NCCL refuses two ranks on one device)

Rendezvous: the parent hosts a ``TCPStore`` on a free port (``CPKV_MASTER_PORT`` if set, else port 0
and the OS picks), children connect to it, so no port is ever raced for.

Failure handling: each child sends ``(rank, ok, payload)`` through its own pipe. When a rank raises or
its process dies, the parent gives the others ``grace_s`` seconds to finish (they may be raising
their own error, e.g. ``ComposeTimeout`` from a barrier) and then ends them; ``launch`` raises
``RankFailure`` naming every failed, dead or late rank. ``exc.results`` (per rank, None where missing)
and ``exc.errors`` (rank -> exception object, when it could be pickled) carry the details.
"""
from __future__ import annotations

import atexit
import os
import pickle
import time
import traceback
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


@dataclass(frozen=True)
class RankContext:
    """One rank's view of the group. ``shared_device``: several ranks of this group use one device."""

    rank: int
    world_size: int
    device: torch.device
    backend: str
    group: Any = None
    shared_device: bool = False

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


def _child(fn: Callable, rank: int, world_size: int, device: str, backend: str, shared: bool, port: int,
           args: tuple, conn: connection.Connection, timeout_s: float) -> None:
    dev = _rank_device(device, rank, shared)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    try:
        store = dist.TCPStore(HOST, port, world_size, is_master=False, timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s))
        ctx = RankContext(rank, world_size, dev, backend, dist.group.WORLD, shared)
        result = fn(ctx, *args)
        conn.send((rank, True, result))
    except BaseException as exc:  # noqa: BLE001 - every failure must reach the parent
        conn.send((rank, False, _failure_payload(exc)))
        conn.close()
        _exit(1)
    try:
        dist.barrier()  # nobody tears down memory a peer may still read
        dist.destroy_process_group()
    finally:
        conn.close()
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
    port = envs.get("CPKV_MASTER_PORT")
    return dist.TCPStore(HOST, port, world_size + 1, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s))


def launch(fn: Callable[..., Any], world_size: int, *, device: str = "cpu", args: Sequence[Any] = (),
           timeout_s: float = 600.0, grace_s: float = 10.0, backend: str | None = None) -> list[Any]:
    """Run ``fn(ctx, *args)`` in ``world_size`` fresh processes; return their results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function). ``timeout_s`` bounds the whole run
    and the process group's collectives; ``grace_s`` is how long the other ranks may still run after a
    first rank failed. Raises ``RankFailure`` naming the ranks that raised, died or did not finish.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    chosen, shared = pick_backend(device, world_size)
    backend = backend or chosen
    store = _free_store(world_size, timeout_s)
    ctx = mp.get_context("spawn")
    procs, conns = [], []
    for rank in range(world_size):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(fn, rank, world_size, device, backend, shared, store.port,
                                              tuple(args), send, timeout_s), name=f"cpkv-rank{rank}")
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    try:
        outcome = _collect(procs, conns, timeout_s, grace_s)
    finally:
        _end(procs)
        del store
    return _finish(outcome, world_size, timeout_s)


def _collect(procs: list, conns: list, timeout_s: float, grace_s: float) -> dict[int, tuple]:
    """rank -> (ok, payload) for every rank that reported; ('dead', exitcode) for dead ones."""
    outcome: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    while len(outcome) < len(procs):
        left = deadline - time.monotonic()
        if left <= 0:
            break
        waitables = {c: r for r, c in enumerate(conns) if r not in outcome}
        waitables.update({procs[r].sentinel: r for r in range(len(procs)) if r not in outcome})
        for obj in connection.wait(list(waitables), timeout=min(left, 1.0)):
            rank = waitables[obj]
            if rank not in outcome:
                outcome[rank] = _read(conns[rank], procs[rank])
                if not outcome[rank][0]:
                    deadline = min(deadline, time.monotonic() + grace_s)
    return outcome


def _read(conn: connection.Connection, proc: Any) -> tuple:
    try:
        if conn.poll(0.5):
            _, ok, payload = conn.recv()
            return ok, payload
    except (EOFError, OSError):
        pass
    proc.join(5.0)
    return False, ("dead", proc.exitcode)


def _end(procs: list) -> None:
    for p in procs:
        p.join(timeout=0.5 if p.is_alive() else 0)
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()


def _finish(outcome: dict[int, tuple], world_size: int, timeout_s: float) -> list[Any]:
    results: list[Any] = [None] * world_size
    errors: dict[int, BaseException | None] = {}
    lines: list[str] = []
    for rank in range(world_size):
        if rank not in outcome:
            lines.append(f"rank {rank} did not finish (killed after the run's {timeout_s:g} s limit or a peer's "
                         f"failure)")
            errors[rank] = None
            continue
        ok, payload = outcome[rank]
        if ok:
            results[rank] = payload
        elif payload[0] == "dead":
            lines.append(f"rank {rank} died with exit code {payload[1]} before returning")
            errors[rank] = None
        else:
            name, msg, tb, blob = payload
            lines.append(f"rank {rank} raised {name}: {msg}\n{_indent(tb)}")
            errors[rank] = _unpickle(blob)
    if lines:
        exc = RankFailure("; ".join(line.split("\n")[0] for line in lines) + "\n" + "\n".join(lines))
        exc.results, exc.errors, exc.failed = results, errors, sorted(errors)  # type: ignore[attr-defined]
        raise exc
    return results


def _unpickle(blob: bytes | None) -> BaseException | None:
    try:
        return pickle.loads(blob) if blob else None
    except Exception:  # noqa: BLE001
        return None


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in text.rstrip().splitlines())


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

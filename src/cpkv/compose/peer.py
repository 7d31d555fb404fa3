"""Peer memory: buffers of one rank that every rank of the group reads (and writes) directly.

    mem = PeerMemory.create(ctx)                  # collective: probe, agree (MIN all-reduce)
    pool = KVPool(..., alloc=mem.alloc)            # device buffers, peer-visible when mem.available
    pad = mem.alloc_host((cp,), "barrier", torch.int64)   # host shared memory (signal pads)
    mem.exchange()                                 # collective: every rank maps every peer's buffers
    mem.peer(r, "pool.token")                      # rank r's buffer, mapped into this process

Transports (``mem.kind``):

- ``shm``: CPU tensors backed by ``/dev/shm/cpkv-<token>-r<rank>-<name>`` files, mapped by every rank
  (``torch.from_file(shared=True)``); files are unlinked once every rank has mapped them, at exit, when
  creating one fails, and by the launching parent after its ranks are gone (the token leads with its pid).
- ``cuda-ipc``: device memory from torch's allocator, its CUDA IPC handle
  (``torch.multiprocessing.reductions.reduce_tensor``) exchanged once with ``all_gather_object`` and
  opened in the reading rank's own device context (peers' buffers then appear on this rank's device,
  whether the ranks share one GPU or have one each).
- ``none``: peer memory off (``CPKV_DISABLE_PEER_MEMORY`` or the probe failed on some rank): ``alloc``
  gives plain tensors and compose modes fall back to collectives.

Host-shared buffers (``alloc_host``) always use ``/dev/shm``: the ranks of a group share one host, and
the counting barrier polls them from the host (also when ranks share one GPU, where a kernel spinning
on a flag could starve the other ranks' kernels).

Every rank must allocate the same names in the same order; ``exchange`` checks it.
"""
from __future__ import annotations

import atexit
import os
import re
import uuid
from typing import Any

import torch

from cpkv import envs
from cpkv.dist import RankContext
from cpkv.errors import ComposeError, PoolExhausted

SHM_DIR = "/dev/shm"
_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")
_IPC_DEVICE_ARG = 6  # storage_device in the arguments of torch's rebuild_cuda_tensor (torch >= 2.0)


class _NotWanted(Exception):
    """This rank does not want peer memory: its probe answers "no"."""


class PeerMemory:
    """Peer-visible buffers of this rank and mapped views of every peer's (see module docstring)."""

    def __init__(self, ctx: RankContext, kind: str, token: str) -> None:
        self.ctx, self.kind, self.token = ctx, kind, token
        self._own: dict[str, tuple[torch.Tensor, bool]] = {}  # name -> (tensor, host)
        self._handles: dict[str, Any] = {}
        self._peers: dict[str, list[torch.Tensor]] = {}
        self._files: list[str] = []
        atexit.register(self._unlink)

    @property
    def available(self) -> bool:
        return self.kind != "none"

    @classmethod
    def create(cls, ctx: RankContext, enabled: bool | None = None) -> PeerMemory:
        """Collective. Probe peer memory on every rank and agree on it with a MIN all-reduce.

        Every rank takes part in the same collectives whatever its own setting says: a rank that does not
        want peer memory (``CPKV_DISABLE_PEER_MEMORY`` set in its environment only) says so in the probe's
        exchange, and the whole group settles on "none" at once.
        """
        token = ctx.all_gather_object(segment_token(os.getppid()) if ctx.rank == 0 else None)[0]
        want = (not envs.get("CPKV_DISABLE_PEER_MEMORY")) if enabled is None else enabled
        kind = "shm" if ctx.device.type == "cpu" else "cuda-ipc"
        probe = cls(ctx, kind, token)
        ok = probe._probe(bool(want))
        agreed = ctx.all_reduce_min(int(ok))
        probe.close()
        return cls(ctx, kind if agreed else "none", token)

    def _probe(self, want: bool = True) -> bool:
        """Write a rank pattern into a device and a host buffer, exchange handles, read every peer's back.
        ``want`` False: allocate nothing, still join the exchange (answering "no")."""
        try:
            if not want:
                raise _NotWanted
            dev = self.alloc((16,), "probe")
            host = self.alloc_host((16,), "probe-host", torch.uint8)
            dev.fill_(self.ctx.rank + 1)
            host.fill_(self.ctx.rank + 1)
            if dev.is_cuda:
                torch.cuda.synchronize(dev.device)
            sent = (True, dict(self._handles))
        except Exception:  # noqa: BLE001 - a failed probe (or _NotWanted) means "no peer memory", agreed by all
            sent = (False, None)
        everyone = self.ctx.all_gather_object(sent)
        ok = all(x[0] for x in everyone)
        if ok:
            try:
                peers = [[self._map(r, n, everyone[r][1][n]) for n in ("probe", "probe-host")]
                         for r in range(self.ctx.world_size)]
                ok = all(int(d[0].item()) == r + 1 and int(h[0].item()) == r + 1
                         for r, (d, h) in enumerate(peers))
            except Exception:  # noqa: BLE001
                ok = False
        self.ctx.barrier()
        return ok

    # allocation -----------------------------------------------------------------------------------

    def alloc(self, shape: tuple[int, ...], name: str, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A zeroed device buffer peers can map (``KVPool``'s ``alloc`` hook). Before ``exchange``."""
        self._check_new(name)
        if self.kind == "none":
            t = torch.zeros(shape, dtype=dtype, device=self.ctx.device)
        elif self.ctx.device.type == "cpu":
            t, path = self._shm(shape, name, dtype)
            self._handles[name] = ("shm", path, tuple(shape), dtype)
        elif self.ctx.world_size == 1:  # no peer to map it: no CUDA IPC export (an exported buffer that no process
            # ever maps stays held by torch's sent-data limbo after its tensor is gone: a run's pool outlived its
            # loop, 7.4 GB at GLM-5's 78 layers, cpkv.engine.memsites)
            t = torch.zeros(shape, dtype=dtype, device=self.ctx.device)
            self._handles[name] = ("own",)
        else:
            t = torch.zeros(shape, dtype=dtype, device=self.ctx.device)
            from torch.multiprocessing.reductions import reduce_tensor
            self._handles[name] = ("ipc", reduce_tensor(t))
        self._own[name] = (t, False)
        return t

    def alloc_host(self, shape: tuple[int, ...], name: str, dtype: torch.dtype = torch.int64) -> torch.Tensor:
        """A zeroed host-shared CPU buffer (signal pads). Always in ``/dev/shm`` (one host per group)."""
        self._check_new(name)
        t, path = self._shm(shape, name, dtype)
        self._handles[name] = ("shm", path, tuple(shape), dtype)
        self._own[name] = (t, True)
        return t

    def _check_new(self, name: str) -> None:
        if not _NAME.match(name):
            raise ComposeError(f"peer buffer names use letters, digits, '.', '_' and '-'; got {name!r}")
        if name in self._own:
            raise ComposeError(f"peer buffer {name!r} is already allocated on rank {self.ctx.rank}")

    def _shm(self, shape: tuple[int, ...], name: str, dtype: torch.dtype) -> tuple[torch.Tensor, str]:
        """A zeroed buffer backed by a new /dev/shm file. The file is removed on every exit path: after the
        exchange, at exit, and at once when creating, sizing or mapping it fails (a failed ftruncate/mmap of a
        huge size must not leave a sparse file of that size behind)."""
        path = os.path.join(SHM_DIR, f"cpkv-{self.token}-r{self.ctx.rank}-{name}")
        nbytes = max(1, _numel(shape) * torch.empty((), dtype=dtype).element_size())
        _check_shm_room(nbytes, name)
        self._files.append(path)  # before the file exists: _unlink removes it whatever happens next
        try:
            flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
        except BaseException:
            _remove(path)
            self._files.remove(path)
            raise
        return flat[: _numel(shape) * torch.empty((), dtype=dtype).element_size()].view(dtype).view(shape), path

    # exchange -------------------------------------------------------------------------------------

    def exchange(self, ok: bool = True) -> None:
        """Collective. Map every peer's buffers allocated since the last exchange."""
        new = [n for n in self._own if n not in self._peers]
        sent = [(n, self._handles.get(n) if ok else None) for n in new]
        everyone = self.ctx.all_gather_object(sent)
        names = [[n for n, _ in x] for x in everyone]
        if any(x != new for x in names):
            raise ComposeError(f"ranks allocated different peer buffers: expected the same names on every rank, "
                               f"got {dict(enumerate(names))}")
        if not ok or any(h is None and self.kind != "none" for x in everyone for _, h in x):
            raise RuntimeError("a rank could not share its buffers")
        for i, name in enumerate(new):
            self._peers[name] = [self._map(r, name, everyone[r][i][1]) for r in range(self.ctx.world_size)]
        self.ctx.barrier()  # every rank mapped every file: the names can go
        self._unlink()

    def _map(self, rank: int, name: str, handle: Any) -> torch.Tensor:
        own, host = self._own[name]
        if rank == self.ctx.rank or handle is None:
            return own
        if handle[0] == "shm":
            _, path, shape, dtype = handle
            nbytes = max(1, _numel(shape) * torch.empty((), dtype=dtype).element_size())
            flat = torch.from_file(path, shared=True, size=nbytes, dtype=torch.uint8)
            return flat[: nbytes if _numel(shape) else 0].view(dtype).view(shape)
        func, args = handle[1]
        if self.ctx.device.type == "cuda" and getattr(func, "__name__", "") == "rebuild_cuda_tensor":
            # Open the handle in this rank's own device context (with one GPU per rank the buffer lives on
            # another GPU): the mapping is then valid for this rank's kernels, which reach it over NVLink
            # (peer access enabled lazily by CUDA). torch would open it in the owner GPU's context, where
            # this rank's kernels fault on it. The tensor is labelled with this rank's device accordingly.
            args = (*args[:_IPC_DEVICE_ARG], self.ctx.device.index, *args[_IPC_DEVICE_ARG + 1:])
        return func(*args)

    def has(self, name: str) -> bool:
        """True when this rank allocated ``name`` through this PeerMemory."""
        return name in self._own

    def peer(self, rank: int, name: str) -> torch.Tensor:
        """Rank ``rank``'s buffer ``name`` as mapped in this process (this rank's own tensor for itself)."""
        if name not in self._peers:
            raise ComposeError(f"peer buffer {name!r} was not exchanged (allocated: {sorted(self._own)})")
        if self.kind == "none" and rank != self.ctx.rank and not self._own[name][1]:
            raise ComposeError(f"peer memory is unavailable; rank {self.ctx.rank} cannot read rank {rank}'s {name!r}")
        return self._peers[name][rank]

    def peers(self, name: str) -> list[torch.Tensor]:
        return [self.peer(r, name) for r in range(self.ctx.world_size)]

    def _unlink(self) -> None:
        for path in self._files:
            _remove(path)
        self._files.clear()

    def close(self) -> None:
        self._unlink()
        self._peers.clear()
        self._own.clear()
        self._handles.clear()


def segment_token(parent: int) -> str:
    """A fresh token for one group's segments, led by the launching parent's pid: ``cpkv.dist.launch`` removes
    ``/dev/shm/cpkv-<parent>x*`` after its ranks are gone, so a rank killed before its exchange (SIGKILL runs
    no atexit handler) leaves nothing behind."""
    return f"{parent}x{uuid.uuid4().hex[:8]}"


def _check_shm_room(nbytes: int, name: str) -> None:
    """PoolExhausted when /dev/shm cannot hold ``nbytes`` more (checked before the file is created)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return
    free = st.f_bavail * st.f_frsize
    if nbytes > free:
        raise PoolExhausted(f"peer buffer {name!r}: needs {nbytes} bytes of {SHM_DIR}, which has {free} free; "
                            "lower --pages-per-rank / --host-pages or --cp")


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n

"""Counting barriers over peer memory (docs/design.md §4): phase-safe, never reset, time out naming the late.

Two implementations of one protocol: ``CountingBarrier`` waits on the host over host-shared pads (CPU
runs, and CUDA without Triton); ``DeviceBarrier`` arrives and waits on the GPU stream over device pads
mapped through CUDA IPC (``cpkv.kernels.barrier.triton``), so the host never drains its stream for a round.
``make_barrier`` picks one. The protocol (host barrier's terms):

Signal pads::

    pad_r : int64 [cp] in rank r's host-shared memory
    pad_r[s] = how many rounds rank s has arrived at (only rank s ever writes cell s of any pad)

Round k on rank r: store k into cell r of every rank's pad (arrive), then poll its own pad until every
cell is >= k (wait). Counters only grow, so

- no reset is ever needed, and
- a fast rank that already arrived at round k+1 stores k+1 >= k: ranks still waiting for round k pass,
  and the fast rank cannot pass k+1 before everyone arrived at k+1 (it is at most one round ahead).

After the last round every pad reads ``[rounds] * cp`` ("drained"). Single-writer cells need no atomic
read-modify-write, so plain stores through numpy views of the shared mapping suffice. Ordering: a full
fence sits between a rank's data writes and its arrival stores, and between seeing every count and
reading peers' data (``_fence``: releasing then re-acquiring a private lock, whose atomics order memory
on weakly ordered CPUs such as aarch64 too; on x86-64 stores are in order anyway).

Host waiting: on CUDA the caller synchronises its stream before arriving (its writes are done) and the
peers' writes were done before they arrived. After ``CPKV_BARRIER_TIMEOUT_S`` (default 60 s) the waiting
rank raises ``ComposeTimeout`` naming the ranks whose count stayed below the round.

Device waiting: the round is one kernel on the rank's stream, after the stream's data writes and before
its reads of peers' data; the kernel's bounded spin records a timeout in a device status buffer instead
of raising (a kernel cannot), and ``DeviceBarrier.check`` (the host, once per batch, after its end-of-batch
synchronisation) raises the same ``ComposeTimeout``.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import torch

from cpkv import envs
from cpkv.compose.peer import PeerMemory
from cpkv.errors import ComposeTimeout

SPINS_BEFORE_YIELD = 2000
SLEEP_S = 20e-6


class CountingBarrier:
    """One group-wide counting barrier. Allocate before ``mem.exchange()``; use after it."""

    def __init__(self, mem: PeerMemory, name: str = "barrier", timeout_s: float | None = None) -> None:
        self.rank, self.world_size = mem.ctx.rank, mem.ctx.world_size
        self.mem, self.name = mem, name
        self.timeout_s = float(envs.get("CPKV_BARRIER_TIMEOUT_S") if timeout_s is None else timeout_s)
        self.local = mem.alloc_host((self.world_size,), name)
        self.rounds = 0
        self._pads: list[np.ndarray] | None = None
        self._lock = threading.Lock()
        self._lock.acquire()  # held by this rank for good; see _fence

    def _peer_pads(self) -> list[np.ndarray]:
        if self._pads is None:
            self._pads = [t.numpy() for t in self.mem.peers(self.name)]
        return self._pads

    def arrive(self) -> int:
        """Announce round ``rounds + 1`` to every rank; returns the round number."""
        self.rounds += 1
        self._fence()  # this rank's data writes before its count
        for pad in self._peer_pads():
            pad[self.rank] = self.rounds
        return self.rounds

    def wait(self) -> None:
        """Block until every rank arrived at this rank's current round, or raise ComposeTimeout."""
        pad = self._peer_pads()[self.rank]
        k = self.rounds
        spins = 0
        deadline = 0.0
        while pad.min() < k:
            spins += 1
            if spins < SPINS_BEFORE_YIELD:
                continue
            now = time.monotonic()
            if not deadline:
                deadline = now + self.timeout_s
            elif now > deadline:
                raise self._timeout(pad, k)
            time.sleep(SLEEP_S)
        self._fence()  # peers' counts before reading their data

    def _fence(self) -> None:
        """A full memory fence: a release of the held lock, then an acquire (ordered release -> acquire)."""
        self._lock.release()
        self._lock.acquire()

    def __call__(self) -> None:
        """One round: arrive, then wait."""
        self.arrive()
        self.wait()

    def counters(self) -> list[int]:
        """This rank's pad: how many rounds each rank has arrived at (as seen here)."""
        return [int(x) for x in self._peer_pads()[self.rank]]

    def _timeout(self, pad: np.ndarray, k: int) -> ComposeTimeout:
        missing = [s for s in range(self.world_size) if int(pad[s]) < k]
        return ComposeTimeout(
            f"rank {self.rank}: counting barrier round {k} timed out after {self.timeout_s:g} s "
            f"(CPKV_BARRIER_TIMEOUT_S); ranks {missing} never arrived (their counts: "
            f"{[int(pad[s]) for s in missing]})")


class DeviceBarrier:
    """The counting barrier on the GPU stream (module docstring). Allocate before ``mem.exchange()``; use
    after it. ``mem`` must be CUDA IPC peer memory and Triton importable (``device_barrier_available``)."""

    def __init__(self, mem: PeerMemory, name: str = "barrier", timeout_s: float | None = None) -> None:
        self.rank, self.world_size = mem.ctx.rank, mem.ctx.world_size
        self.mem, self.name = mem, name
        self.timeout_s = float(envs.get("CPKV_BARRIER_TIMEOUT_S") if timeout_s is None else timeout_s)
        self.pad = mem.alloc((self.world_size,), f"{name}.pad", torch.int64)
        self.state = torch.zeros(2 + self.world_size, dtype=torch.int64, device=self.pad.device)
        self.rounds = 0
        self._launch = None

    def _launcher(self):
        if self._launch is None:
            from cpkv.kernels.barrier.triton import barrier_launcher

            addrs = [t.data_ptr() for t in self.mem.peers(f"{self.name}.pad")]
            peers = torch.tensor(addrs, dtype=torch.int64, device=self.pad.device)
            self._launch = barrier_launcher(peers, self.pad, self.state, self.rank, int(self.timeout_s * 1e9))
        return self._launch

    def bind(self) -> None:
        """Compile and bind the kernel now (after ``mem.exchange()``), so the first round launches at once."""
        self._launcher()


    def __call__(self) -> None:
        """One round, enqueued on the current stream: no host wait."""
        self._launcher()()
        self.rounds += 1

    def check(self) -> None:
        """Raise ComposeTimeout if a round timed out on the device (reads the status: a synchronisation,
        meant for the end of a batch)."""
        st = self.state.cpu().tolist()
        if st[1]:
            k, counts = st[1], st[2:]
            missing = [s for s in range(self.world_size) if counts[s] < k]
            raise ComposeTimeout(
                f"rank {self.rank}: GPU counting barrier round {k} timed out after {self.timeout_s:g} s "
                f"(CPKV_BARRIER_TIMEOUT_S); ranks {missing} never arrived (their counts: "
                f"{[counts[s] for s in missing]})")

    @property
    def direct(self) -> bool:
        """True while rounds launch the compiled kernel directly (not through Triton's JIT launcher)."""
        return self._launcher().direct()

    def counters(self) -> list[int]:
        """This rank's pad as seen now (a synchronisation; tests)."""
        return [int(x) for x in self.pad.cpu().tolist()]


def device_barrier_available(mem: PeerMemory) -> bool:
    """True where the GPU barrier can run: CUDA IPC peer memory, Triton importable, not disabled."""
    from cpkv.kernels.platform import use_triton

    return mem.kind == "cuda-ipc" and use_triton(mem.ctx.device)


def make_barrier(mem: PeerMemory, name: str = "barrier",
                 timeout_s: float | None = None) -> CountingBarrier | DeviceBarrier:
    """The GPU barrier where it can run, else the host one (see ``device_barrier_available``)."""
    cls = DeviceBarrier if device_barrier_available(mem) else CountingBarrier
    return cls(mem, name, timeout_s)

"""Host data onto a device without a host synchronisation (plans are built from host data once per batch).

A CPU tensor copied to CUDA from pageable memory is a synchronous copy: the host waits for the stream to
drain, which exposes every launch latency behind it. ``upload`` copies asynchronously on the current
stream from pinned memory. Pinning per call (``Tensor.pin_memory``) costs milliseconds of host time, so
inside ``staging(device)`` uploads take consecutive slices of one pinned buffer kept per device:

    with staging(device):        # enter only when no copy of an earlier scope can still be in flight
        plan = build_plan(...)   # (the engine enters it right after its batch-start synchronisation)

The buffer grows when a scope needs more; a replaced buffer is kept until the next scope starts. Outside
a scope each upload pins its own copy (torch's caching host allocator keeps it until the copy has run).

``staging(device, slot)`` picks one of two buffers: the engine builds batch n+1's plan (slot 1 - s) while batch
n's copies from slot s may still be queued; a scope nested in another uses its own slot and gives the outer
one back when it ends. Each scope records an event when it ends (after its last copy); a slot entered again is
reset only once that event has passed (a host wait, normally over at once: the engine's chained batches are
the case where it is not). ``keep=True`` continues the slot where its last scope left off instead (nothing of
it is overwritten): a batch planned ahead runs its forward in the slot its plan was staged in, with the plan's
copies possibly still queued behind the batch before.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator, Sequence

import numpy as np
import torch

ALIGN = 256
SLOTS = 2
_STAGES: dict[tuple[torch.device, int], "_Stage"] = {}
_ACTIVE: dict[torch.device, "_Stage"] = {}  # the innermost open scope's stage per device


class _Stage:
    """One device's pinned staging buffer: bump offset inside a scope, reset when a scope starts."""

    def __init__(self, pin: bool = True) -> None:
        self.buf = torch.empty(0, dtype=torch.uint8)
        self.pin = pin
        self.used = 0
        self.active = False
        self.retired: list[torch.Tensor] = []
        self.done: torch.cuda.Event | None = None  # recorded when the last scope ended (after its copies)
        self._aliases: dict[np.dtype, tuple[torch.Tensor, np.ndarray]] = {}  # of self.buf, per dtype

    def _reserve(self, nbytes: int) -> int:
        """The byte offset of the next ``nbytes`` (ALIGN-aligned), growing the buffer if needed."""
        start = -(-self.used // ALIGN) * ALIGN
        if start + nbytes > self.buf.numel():
            self.retired.append(self.buf)  # copies from it may be in flight until the scope's batch ends
            self.buf = torch.empty(max(2 * self.buf.numel(), nbytes, 1 << 20), dtype=torch.uint8, pin_memory=self.pin)
            self._aliases.clear()
            start = 0
        self.used = start + nbytes
        return start

    def take(self, nbytes: int) -> torch.Tensor:
        start = self._reserve(nbytes)
        return self.buf[start: start + nbytes]

    def take_typed(self, n: int, dtype: np.dtype) -> tuple[np.ndarray, torch.Tensor, int]:
        """``n`` elements of ``dtype``: (their host array, the whole buffer as a tensor of that dtype, the first
        element's index in it). Both are aliases of the buffer kept per dtype, so nothing here runs a torch op
        (each costs µs, more under the profiler, on the way to a batch's first copy)."""
        start = self._reserve(n * dtype.itemsize)
        alias = self._aliases.get(dtype)
        if alias is None:
            whole = self.buf[: self.buf.numel() - self.buf.numel() % dtype.itemsize]
            typed = whole.view(torch.from_numpy(np.empty(0, dtype)).dtype)  # a view: torch still sees pinned memory
            alias = self._aliases[dtype] = (typed, typed.numpy())
        at = start // dtype.itemsize
        return alias[1][at: at + n], alias[0], at


@contextlib.contextmanager
def staging(device: torch.device | str, slot: int = 0, keep: bool = False) -> Iterator[None]:
    """Uploads to ``device`` inside use the reused pinned buffer ``slot`` (0 or 1); ``keep``: continue after what
    the slot's last scope staged instead of starting over (module docstring). No-op off CUDA."""
    if slot not in range(SLOTS):
        raise ValueError(f"staging slot must be 0 or 1, got {slot!r}")
    device = _key(device)
    if device.type != "cuda":
        yield
        return
    st = _STAGES.setdefault((device, slot), _Stage())
    if st.active:
        raise RuntimeError(f"staging slot {slot} of {device} is already open")
    outer = _ACTIVE.get(device)
    if not keep:
        while st.done is not None and not st.done.query():  # until the slot's queued copies have run (polled: a
            time.sleep(2e-5)                                  # wait for the batch before, not a sync in a forward)
        st.used = 0
        st.retired.clear()
    st.active = True
    _ACTIVE[device] = st
    try:
        yield
    finally:
        st.active = False
        st.done = torch.cuda.Event()
        st.done.record(torch.cuda.current_stream(device))
        if outer is not None:
            _ACTIVE[device] = outer
        else:
            _ACTIVE.pop(device, None)


def upload(host: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device``: asynchronous through pinned memory on CUDA; on the CPU the
    tensor itself (no copy)."""
    device = _key(device)
    if device.type != "cuda":
        return host.to(device)
    st = _ACTIVE.get(device)
    if st is None or not st.active or not host.numel():
        return host.pin_memory().to(device, non_blocking=True)
    src = host.contiguous()
    pinned = st.take(src.numel() * src.element_size())
    # a plain memcpy (numpy): torch's copy_ would split it over its intra-op threads, whose wake-up (or a
    # busy core under host load) costs milliseconds on a path the GPU waits on
    np.copyto(pinned.numpy(), src.view(-1).view(torch.uint8).numpy())
    return pinned.view(src.dtype).view(src.shape).to(device, non_blocking=True)


def _key(device: torch.device | str) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


class Staged:
    """Host arrays laid out for one upload (``stage``): fill each of ``host`` in place, then ``send``."""

    def __init__(self, flat: np.ndarray, pinned: tuple[torch.Tensor, int] | None, spans: list[tuple[int, int]],
                 device: torch.device) -> None:
        self.host = [flat[a: a + n] for a, n in spans]
        self._flat, self._pinned, self._spans, self._device = flat, pinned, spans, device

    def send(self) -> list[torch.Tensor]:
        """The filled arrays on the device, each a 1-D view of one tensor (one asynchronous copy on CUDA; on the CPU
        the host memory itself)."""
        if self._device.type != "cuda":
            dev = torch.from_numpy(self._flat)
        elif self._pinned is not None:
            whole, at = self._pinned  # the staging buffer as this dtype: the slice keeps its pinned storage
            dev = whole[at: at + self._flat.size].to(self._device, non_blocking=True)
        else:
            dev = torch.from_numpy(self._flat).pin_memory().to(self._device, non_blocking=True)
        return [dev[a: a + n] for a, n in self._spans]


def stage(sizes: Sequence[int], dtype: np.dtype | type, device: torch.device | str) -> Staged:
    """Host arrays of ``sizes`` elements of ``dtype``, to be filled in place and sent to ``device`` in one copy.

    Inside a ``staging`` scope on CUDA they are slices of the scope's pinned buffer itself: nothing is copied on
    the host and no fresh memory is touched (fresh numpy arrays of a 32K-token batch cost ~0.5 ms of page faults
    before its first kernel). Each array starts on a 16-byte boundary (as a tensor of its own would: kernels
    specialise on pointer alignment); the padding between them is left as it was."""
    device, dtype = _key(device), np.dtype(dtype)
    if any(int(n) < 0 for n in sizes):
        raise ValueError(f"stage: sizes must be >= 0, got {list(sizes)}")
    unit = max(16 // dtype.itemsize, 1)
    spans, at = [], 0
    for n in sizes:
        spans.append((at, int(n)))
        at += -(-int(n) // unit) * unit
    st = _ACTIVE.get(device) if device.type == "cuda" else None
    if st is not None and st.active and at:
        flat, whole, first = st.take_typed(at, dtype)
        return Staged(flat, (whole, first), spans, device)
    return Staged(np.empty(at, dtype=dtype), None, spans, device)


def upload_arrays(arrays: Sequence[np.ndarray], device: torch.device | str) -> list[torch.Tensor]:
    """Host arrays of one dtype -> their tensors on ``device`` (shapes kept), through one ``stage``: one copy (and
    one staging slice) where one per array would each pay a copy's host work. Each result is a view of that one
    device tensor, starting on a 16-byte boundary."""
    arrays = [np.asarray(a) for a in arrays]
    dtypes = {a.dtype for a in arrays}
    if len(dtypes) != 1:
        raise ValueError(f"upload_arrays needs one dtype, got {sorted(map(str, dtypes))}")
    staged = stage([a.size for a in arrays], next(iter(dtypes)), device)
    for h, a in zip(staged.host, arrays):
        h[...] = a.reshape(-1)
    return [d.view(a.shape) for d, a in zip(staged.send(), arrays)]

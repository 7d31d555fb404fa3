"""Timeline marks: where a batch's host and its GPU are, side by side, without a profiler (benchmarks).

The forward calls ``mark(label)`` at its milestones (the plan built, each layer's projections, compose,
indexer, attention, MLP). Nothing happens unless a ``Recorder`` is active (one global read per mark). An
active recorder notes, per mark, the host's clock and a CUDA event recorded on the current stream there. After
the batch's end synchronisation, ``Recorder.rows`` gives, per mark, (label, host ms, GPU ms), both on the host's
clock, from when the host began the batch. The GPU's times come from a synchronisation point (``sync``: a host
time and an event recorded right after it, when the GPU was idle): the batch start's own, or for a batch chained on
the one before (launched while the GPU still ran that one: its first kernels wait for it) the chain's:

- host ms: when the host had launched everything before the mark;
- GPU ms: when the GPU had run it.

With ``clocks``, each mark also runs a spin of ``PROBE_CYCLES`` SM clock cycles between two events: its length
gives the SM clock there (MHz, a fourth column), e.g. a power cap lowering it under a long run of GEMMs (each
probe adds ~30 us of GPU time). A probe is exact where the host is ahead (its spin queued behind work); where the
GPU waited for the host it also holds the spin's launch latency and reads low.

GPU ms - host ms is how far the host was ahead there. A few hundredths of a millisecond means the GPU was waiting
for the host's launches at that point; the batch is host-bound there. The profiler shows the same, but inflates
the host's side several-fold.
"""
from __future__ import annotations

import contextlib
import time
from typing import Iterator

import torch

_ACTIVE: "Recorder | None" = None
PROBE_CYCLES = 50_000
_ANCHORS: dict = {}  # per device: the first recorder's start event, one GPU clock for every batch of a process


def mark(label: str) -> None:
    """A milestone of the running batch (no-op unless a Recorder is active)."""
    if _ACTIVE is not None:
        _ACTIVE.mark(label)


class Recorder:
    """Marks of one batch on a CUDA device (module docstring)."""

    def __init__(self, device: torch.device, clocks: bool = False, sync: tuple | None = None) -> None:
        self.device, self.clocks = device, clocks
        self.unix_start = time.time()  # the batch start on the wall clock (to line up with other samplers)
        self._t0 = time.perf_counter()
        self._start = torch.cuda.Event(enable_timing=True)
        self._start.record()
        # (host seconds, an event recorded right after that synchronisation): GPU times onto the host's clock
        self._sync = sync if sync is not None and sync[1] is not None else (self._t0, self._start)
        self._anchor = _ANCHORS.setdefault(device, self._sync[1])
        self._marks: list[tuple[str, float, torch.cuda.Event]] = []

    def mark(self, label: str) -> None:
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        probe = None
        if self.clocks:
            probe = torch.cuda.Event(enable_timing=True)
            torch.cuda._sleep(PROBE_CYCLES)  # spins PROBE_CYCLES cycles of the SM clock
            probe.record()
        self._marks.append((label, time.perf_counter(), ev, probe))

    def rows(self) -> list[tuple]:
        """(label, host ms, GPU ms[, SM MHz]) per mark, in order; call after a synchronisation covering the
        batch."""
        out = []
        host, ev0 = self._sync
        base = (host - self._t0) * 1e3  # the synchronisation point, in ms from the batch's host start (<= 0)
        for label, t, ev, probe in self._marks:
            row = (label, round((t - self._t0) * 1e3, 3), round(base + ev0.elapsed_time(ev), 3))
            if probe is not None:
                row += (round(PROBE_CYCLES / ev.elapsed_time(probe) / 1e3),)
            out.append(row)
        return out

    def gpu_start_ms(self) -> float:
        """Where the rows' GPU times start (the batch's host start, through its synchronisation point) on the
        process's GPU clock (ms after the first recorded batch's start): batches' marks side by side, e.g. the
        GPU's idle between one batch's last mark and the next one's first."""
        host, ev0 = self._sync
        at = self._anchor.elapsed_time(ev0) if self._anchor is not ev0 else 0.0
        return round(at + (self._t0 - host) * 1e3, 3)


@contextlib.contextmanager
def recording(device: torch.device, on: bool = True, clocks: bool = False,
              sync: tuple | None = None) -> Iterator[Recorder | None]:
    """A Recorder (``clocks``: with clock probes) active inside (yielded; None when ``on`` is false or ``device`` is
    not CUDA). ``sync``: (host seconds, CUDA event) of the last synchronisation before the batch (module
    docstring); None: the Recorder's own start, so enter it right after the batch-start synchronisation. Read its
    rows after the end one."""
    global _ACTIVE
    if not on or device.type != "cuda":
        yield None
        return
    if _ACTIVE is not None:
        raise RuntimeError("a timeline Recorder is already active")
    rec = Recorder(device, clocks, sync)
    _ACTIVE = rec
    try:
        yield rec
    finally:
        _ACTIVE = None


@contextlib.contextmanager
def paused() -> Iterator[None]:
    """No marks inside (a CUDA graph's capture: its pieces' marks would be captured events; the replay is marked
    instead)."""
    global _ACTIVE
    rec, _ACTIVE = _ACTIVE, None
    try:
        yield
    finally:
        _ACTIVE = rec


def sm_clock_mhz() -> int:
    """The current SM clock (MHz) of the current CUDA device, from a spin of PROBE_CYCLES cycles between two
    events (synchronises)."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(PROBE_CYCLES)  # holds the stream: the probe below queues behind it, no launch gap inside
    a.record()
    torch.cuda._sleep(PROBE_CYCLES)
    b.record()
    b.synchronize()
    return round(PROBE_CYCLES / a.elapsed_time(b) / 1e3)

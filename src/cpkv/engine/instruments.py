"""The measurement side of a rank's batches: what a benchmark or a test asks to see, kept apart from the executor.

    MeasureConfig   the switches (profiler, trace export, sync check, timeline marks, host profile, a planted
                    rank death), passed beside an EngineConfig by ``cpkv bench engine`` and the tests
    Instruments     one run's records: per batch its time (plan to logits), host launch time, entries, whether it
                    was planned ahead; with the switches, its kernels and host ops (one profiler over the run),
                    host functions (cProfile), timeline marks, and a Chrome trace per batch
    NoInstruments   the null object: every hook does nothing (the online loop keeps no records)

The executor calls the same hooks on either, so its batch code has no measurement branches. None of the hooks
synchronises the device inside a batch's plan + forward.
"""
from __future__ import annotations

import bisect
import contextlib
import os
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Iterator, Sequence

import torch

from cpkv.errors import ConfigError
from cpkv.timeline import recording

HOST_TOP = 12
HOST_FUNCS_TOP = 40
SYNC_WARNING = "called a synchronizing CUDA operation"  # torch's sync-debug message


@dataclass(frozen=True)
class MeasureConfig:
    """What a run measures beyond its batch times (every switch off: a plain timed run).

    ``sync_check`` (CUDA): each batch's plan and forward under torch's sync debug mode, one error naming every
    device->host synchronisation. ``profile`` (CUDA): each batch's kernels (name, start, end) from one profiler
    over the run, so that batches chain as unprofiled (``split_spans``). ``host_profile``: each batch's plan +
    forward under cProfile (the host functions with the most cumulative time). ``marks`` (CUDA): each batch's
    timeline marks, host vs GPU ms (``cpkv.timeline``); ``mark_clocks``: the SM clock at each mark too.
    ``trace_dir`` (with ``profile``): each batch's timeline as a gzipped Chrome trace ``rank<r>_batch<k>.json.gz``
    (a profiler per batch: these batches are not chained), with the host's Python stacks unless ``trace_stacks``
    is off. ``fault`` (tests): (rank, batch) -> that rank's process exits after that batch. ``plant`` (tests): a
    planted fault (``cpkv.engine.taps.PLANTS``) the run's verification must catch; eager runs only.
    """

    sync_check: bool = False
    profile: bool = False
    host_profile: bool = False
    marks: bool = False
    mark_clocks: bool = False
    trace_stacks: bool = True
    trace_dir: str | None = None
    fault: tuple[int, int] | None = None
    plant: str | None = None

    def __post_init__(self) -> None:
        if self.plant is not None:
            from cpkv.engine.taps import PLANTS
            if self.plant not in PLANTS:
                raise ConfigError(f"unknown planted fault {self.plant!r}; expected one of {', '.join(PLANTS)}")
        if self.fault is not None and (len(self.fault) != 2 or min(self.fault) < 0):
            raise ConfigError(f"fault must be (rank, batch) with both >= 0, got {self.fault!r}")
        if self.mark_clocks and not self.marks:
            raise ConfigError("mark_clocks records the SM clock at each mark: it needs marks too")


class NoInstruments:
    """The null instruments: the executor's hooks, each doing nothing."""

    plant = None

    def run_scope(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def batch_profiler(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def batch_range(self, prof: Any) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def sync_checked(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def host_profiled(self) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def recording(self, start: tuple) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def launched(self, launch: float) -> None:
        pass

    def ended(self, spans: Sequence[tuple[float, Any]]) -> None:
        pass

    def after_batch(self, batch: Any, index: int, ahead: bool, prof: Any, host_prof: Any) -> None:
        pass


class Instruments:
    """One rank's records of one run, and the measurement the ``MeasureConfig`` asks for (module docstring)."""

    def __init__(self, measure: MeasureConfig, rank: int, device: torch.device) -> None:
        self.measure, self.rank, self.device = measure, rank, device
        self.plant = measure.plant  # the executor hands it to the model's tap
        self.cuda = device.type == "cuda"
        self.batch_log: list[list[tuple]] = []  # per batch: (id, prefix_len, extend_len, chunked, last_chunk)
        self.batch_s: list[float] = []  # per batch: seconds from plan to logits (device synced); a batch
        #                                 planned ahead: from the end of the batch before
        self.batch_ahead: list[bool] = []  # per batch: was its plan built during the batch before
        self.host_s: list[float] = []  # per batch: seconds until the host had launched its whole forward
        self.kernels: list[list[tuple[str, float, float]]] = []  # per batch, profiled: (name, start us, end us)
        self.host_ops: list[list[tuple[str, float, int]]] = []  # per batch, profiled: top host ops (name, ms, calls)
        self.host_funcs: list[list[tuple[str, float, float, int]]] = []  # per batch, host_profile: cProfile rows
        self.marks: list[dict] = []  # per batch, marks: {"unix_start", "gpu_start_ms", "rows"}
        self._run_prof: Any = None  # profile on CUDA without trace_dir: one profiler over the run

    # -- scopes the executor enters ----------------------------------------------------------------
    @contextlib.contextmanager
    def run_scope(self) -> Iterator[None]:
        """The whole run: with ``profile`` on CUDA and no ``trace_dir``, one torch profiler over it (a profiler per
        batch would synchronise at each end), its kernels split by batch on exit (``batch_spans``)."""
        m = self.measure
        if not (m.profile and self.cuda and not m.trace_dir):
            yield
            return
        with self._profiler() as prof:
            self._run_prof = prof
            yield
        self._run_prof = None
        self.kernels, self.host_ops = batch_spans(prof)

    def batch_profiler(self) -> contextlib.AbstractContextManager:
        """With ``trace_dir`` (and ``profile``): a torch profiler recording one batch (yielded), else None."""
        if not (self.measure.profile and self.measure.trace_dir):
            return contextlib.nullcontext()
        return self._profiler()

    def batch_range(self, prof: Any) -> contextlib.AbstractContextManager:
        """A profiler range around a batch's plan, forward and logits copies (anchors its kernels: ``split_spans``);
        nothing unprofiled."""
        if prof is None and self._run_prof is None:
            return contextlib.nullcontext()
        return torch.profiler.record_function("cpkv.batch")

    def sync_checked(self) -> contextlib.AbstractContextManager:
        """With ``sync_check`` on CUDA: one error naming every device->host synchronisation inside."""
        if not (self.measure.sync_check and self.cuda):
            return contextlib.nullcontext()
        return sync_debug_error()

    def host_profiled(self) -> contextlib.AbstractContextManager:
        """With ``host_profile``: a cProfile.Profile enabled inside (yielded), else None."""
        return host_profiled(self.measure.host_profile)

    def recording(self, start: tuple) -> contextlib.AbstractContextManager:
        """With ``marks``: a timeline Recorder from ``start`` (host seconds, CUDA event), else None."""
        return recording(self.device, self.measure.marks, self.measure.mark_clocks, start)

    # -- records -----------------------------------------------------------------------------------
    def launched(self, launch: float) -> None:
        """The host has launched every kernel of the batch's forward (it started at ``launch``)."""
        self.host_s.append(time.perf_counter() - launch)

    def ended(self, spans: Sequence[tuple[float, Any]]) -> None:
        """Batches known to have ended, in order: (seconds, their timeline Recorder or None) each."""
        for secs, rec in spans:
            self.batch_s.append(secs)
            if rec is not None:
                self.marks.append({"unix_start": rec.unix_start, "gpu_start_ms": rec.gpu_start_ms(),
                                   "rows": rec.rows()})

    def after_batch(self, batch: Any, index: int, ahead: bool, prof: Any, host_prof: Any) -> None:
        """Batch ``index`` (counted from 1) is launched and its scopes closed: its trace, host functions and entries
        recorded; the planted fault, when it is this rank's and this batch's, ends the process."""
        if prof is not None:  # the trace alone (torch's event parse fails after stacks)
            export_trace(prof, os.path.join(self.measure.trace_dir, f"rank{self.rank}_batch{index - 1}.json.gz"))
        if host_prof is not None:
            self.host_funcs.append(host_functions(host_prof))
        self.batch_log.append([(e.rid, e.prefix_len, e.extend_len, e.chunked, e.last_chunk) for e in batch.entries])
        self.batch_ahead.append(ahead)
        if self.measure.fault == (self.rank, index):
            os._exit(3)  # fault injection (tests): this rank dies mid-run

    def stats(self) -> dict[str, Any]:
        """The records, keyed as ``RankOutput.stats`` carries them."""
        return {"batch_log": self.batch_log, "batch_s": self.batch_s, "kernels": self.kernels,
                "host_ops": self.host_ops, "host_funcs": self.host_funcs, "batch_ahead": self.batch_ahead,
                "host_s": self.host_s, "marks": self.marks}

    def _profiler(self):
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        return profile(activities=acts, with_stack=bool(self.measure.trace_dir) and self.measure.trace_stacks)


# -- the sync check --------------------------------------------------------------------------------
@contextlib.contextmanager
def sync_debug_error() -> Iterator[None]:
    """Inside: every device->host synchronisation is recorded with the cpkv frames that reached it (torch's
    sync debug mode "warn", each warning caught with its stack); on exit one error lists them all, so one
    GPU run names every site rather than the first. A canary sync on entry proves the warnings arrive; where
    they would not, torch's "error" mode stops at the first sync instead (never a silent pass)."""
    sites: dict[str, int] = {}

    def seen(message, category, filename, lineno, file=None, line=None):
        if SYNC_WARNING not in str(message):
            return shown(message, category, filename, lineno, file, line)
        site = sync_site(traceback.extract_stack()[:-1])
        sites[site] = sites.get(site, 0) + 1

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown, warnings.showwarning = warnings.showwarning, seen
        torch.cuda.set_sync_debug_mode("warn")
        _canary()  # one known sync: if its warning does not reach ``seen``, fall back to stopping at the first
        if not sites:
            torch.cuda.set_sync_debug_mode("error")
        sites.clear()
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    if sites:
        raise RuntimeError(f"{sum(sites.values())} device->host synchronisations in a batch's plan + forward: "
                           + "; ".join(f"{n}x {s}" for s, n in sites.items()))


def _canary() -> None:
    """A synchronisation known to trigger torch's sync debug check (the stream is idle at a batch's start)."""
    torch.cuda.current_stream().synchronize()


def sync_site(stack: traceback.StackSummary) -> str:
    """``a.py:12 f < b.py:40 g``: the cpkv frames of a stack, innermost first (the whole stack's last three
    frames when none is cpkv's)."""
    stack = [f for f in stack if os.path.basename(f.filename) != "warnings.py"]
    mine = [f for f in stack if f"{os.sep}cpkv{os.sep}" in f.filename]
    frames = (mine or stack[-3:])[::-1][:6]
    return " < ".join(f"{os.path.basename(f.filename)}:{f.lineno} {f.name}" for f in frames)


# -- the host profile ------------------------------------------------------------------------------
@contextlib.contextmanager
def host_profiled(on: bool) -> Iterator[Any]:
    """With ``on``: a cProfile.Profile enabled inside (yielded; disabled on exit), else None."""
    if not on:
        yield None
        return
    import cProfile

    prof = cProfile.Profile()
    prof.enable()
    try:
        yield prof
    finally:
        prof.disable()


def host_functions(prof, top: int = HOST_FUNCS_TOP) -> list[tuple[str, float, float, int]]:
    """The functions with the most cumulative time in a cProfile'd batch: (``file.py:line name``, cumulative
    ms, own ms, calls), cumulative-descending (the batch's host time, inclusive of what each function called),
    then those of the ``top // 2`` with the most own time not among them (where leaf time goes: launchers, aten)."""
    import pstats

    st = pstats.Stats(prof).stats  # {(file, line, name): (primitive calls, calls, own s, cumulative s, callers)}
    rows = sorted(st.items(), key=lambda kv: -kv[1][3])[:top]
    seen = {k for k, _ in rows}
    rows += [kv for kv in sorted(st.items(), key=lambda kv: -kv[1][2])[: top // 2] if kv[0] not in seen]
    return [(f"{os.path.basename(f)}:{ln} {name}"[:100], round(ct * 1e3, 3), round(tt * 1e3, 3), nc)
            for (f, ln, name), (_, nc, tt, ct, _) in rows]


# -- the profiler's records ------------------------------------------------------------------------
def export_trace(prof, path: str) -> None:
    """The profiled batch as a gzipped Chrome trace (chrome://tracing, Perfetto) at ``path``."""
    import gzip
    import shutil
    import tempfile

    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(raw)
        with open(raw, "rb") as src, gzip.open(path, "wb", compresslevel=6) as dst:
            shutil.copyfileobj(src, dst)


def batch_spans(prof) -> tuple[list[list[tuple[str, float, float]]], list[list[tuple[str, float, int]]]]:
    """A run's profiler -> per batch, in order: its kernels (:func:`split_spans`: name, start us, end us from the
    batch's start) and its host ops with the most self time (name, self ms, calls) inside its ``cpkv.batch``
    range."""
    from torch.autograd import DeviceType

    events = prof.events()
    ranges = sorted((e for e in events if e.name == "cpkv.batch" and e.device_type == DeviceType.CPU),
                    key=lambda e: e.time_range.start)
    # each range's GPU-side annotation (the profiler's): from the first kernel launched inside it to the end of the
    # last one
    gpu = sorted((e.time_range.start, e.time_range.end) for e in events
                 if e.name == "cpkv.batch" and e.device_type == DeviceType.CUDA)
    kernels = [(e.name, e.time_range.start, e.time_range.end) for e in events
               if e.device_type == DeviceType.CUDA and e.name != "cpkv.batch"]
    spans = split_spans(kernels, [e.time_range.start for e in ranges], gpu if len(gpu) == len(ranges) else None)
    return spans, [_host_ops(events, r) for r in ranges]


def _host_ops(events, r) -> list[tuple[str, float, int]]:
    """The host ops with the most self time inside the range ``r``: (name, self ms, calls)."""
    from torch.autograd import DeviceType

    own: dict[str, list] = {}
    for e in events:
        if (e.device_type == DeviceType.CPU and e is not r and r.time_range.start <= e.time_range.start
                and e.time_range.end <= r.time_range.end):
            row = own.setdefault(e.name[:100], [0.0, 0])
            row[0] += e.self_cpu_time_total
            row[1] += 1
    top = sorted(own.items(), key=lambda kv: -kv[1][0])[:HOST_TOP]
    return [(name, round(us / 1e3, 3), n) for name, (us, n) in top]


def split_spans(kernels: Sequence[tuple[str, float, float]], host_starts: Sequence[float],
                gpu_ranges: Sequence[tuple[float, float]] | None) -> list[list[tuple[str, float, float]]]:
    """One profiled run's kernels split by batch.

    ``kernels``: (name, start us, end us), on the profiler's clock (the host's: CUPTI converts); ``host_starts``:
    each batch's ``cpkv.batch`` range start on the host, in batch order; ``gpu_ranges``: each range's GPU-side
    annotation (from the first kernel launched inside it to the end of the last), or None where the profiler
    gave none. A batch holds the kernels starting inside its GPU range (one stream runs a batch's kernels, then
    its logits copies, then the next batch's: a chained batch's kernels are launched while the one before still
    runs, so launch time would not tell them apart); without GPU ranges, those starting from its host start
    until the next batch's. Kernels before the first batch or between two batches' GPU ranges (the host's work
    after a batch has ended, such as reading its logits or the barrier's state) are left out. Times are from the
    batch's start: its host start, or, chained (the batch before still running then), the end of the batch
    before's last kernel, where its own GPU time begins: what is idle from there is the GPU waiting for this
    batch's host work.
    -> per batch [(name, start, end)], start-sorted."""
    bounds = [g[0] for g in gpu_ranges] if gpu_ranges is not None else list(host_starts)
    ends = [g[1] for g in gpu_ranges] if gpu_ranges is not None else [float("inf")] * len(bounds)
    out: list[list[tuple[str, float, float]]] = [[] for _ in bounds]
    for name, a, b in sorted(kernels, key=lambda k: k[1]):
        i = bisect.bisect_right(bounds, a) - 1
        if i >= 0 and a < ends[i]:
            out[i].append((name, a, b))
    spans, prev_end = [], float("-inf")
    for host, ks in zip(host_starts, out):
        t0 = max(host, prev_end)
        spans.append([(n, a - t0, b - t0) for n, a, b in ks])
        prev_end = max((b for _, _, b in ks), default=prev_end)
    return spans

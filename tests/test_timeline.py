"""cpkv.timeline: marks are free without a recorder; on CUDA they line up the host's and the GPU's clocks."""
from __future__ import annotations

import pytest
import torch

from cpkv.bench.engine import marks_of
from cpkv.timeline import mark, recording


def test_marks_without_a_recorder_or_off_cuda_record_nothing():
    mark("nothing listens")  # no recorder: a no-op
    with recording(torch.device("cpu")) as rec:
        mark("still nothing")
    assert rec is None
    with recording(torch.device("cpu"), on=False) as rec:
        assert rec is None


def test_marks_of_a_case_gives_the_gpu_idle_before_each_chunk():
    """Chunk k+1's idle: from chunk k's last mark to chunk k+1's first, on the process's GPU clock."""
    stats = {"batch_s": [0.5, 0.1, 0.2, 0.3],
             "marks": [{"unix_start": 1.0, "gpu_start_ms": 0.0, "rows": [("a", 0.1, 0.15), ("z", 1.0, 90.0)]},
                       {"unix_start": 2.0, "gpu_start_ms": 100.0, "rows": [("a", 0.1, 0.5), ("z", 2.0, 80.0)]},
                       {"unix_start": 3.0, "gpu_start_ms": 180.0, "rows": [("a", 0.1, 0.25), ("z", 2.0, 50.0)]},
                       {"unix_start": 4.0, "gpu_start_ms": 300.0, "rows": [("a", 0.3, 1.0)]}]}
    got = marks_of(stats, [1, 2, 3])
    assert got["rows"] == stats["marks"][1]["rows"] and got["batch_s"] == 0.1
    assert got["columns"] == ["label", "host_ms", "gpu_ms"]
    assert got["chunk_start_idle_ms"] == [0.25, 71.0]  # 180 + 0.25 - (100 + 80); 300 + 1 - (180 + 50)
    assert "chunk_start_idle_ms" not in marks_of(stats, [0])
    # the GPU reached "a" 0.05 ms after the host issued it (waiting), "z" 89 ms after (the host far ahead)
    assert marks_of(stats, [0])["gpu_waits_for_host_until_ms"] == 0.15
    assert marks_of(stats, [3])["gpu_waits_for_host_until_ms"] == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_recorder_sees_the_gpu_behind_the_host_and_the_clock():
    torch.cuda.synchronize()
    with recording(torch.device("cuda")):
        with pytest.raises(RuntimeError, match="already active"):
            with recording(torch.device("cuda")):
                pass
    with recording(torch.device("cuda"), clocks=True) as rec:
        torch.cuda._sleep(100_000_000)  # the GPU busy for tens of ms: the host races ahead
        mark("after the spin")
    torch.cuda.synchronize()
    (label, host_ms, gpu_ms, mhz), = rec.rows()
    assert label == "after the spin" and gpu_ms > host_ms + 10
    assert 100 <= mhz <= 5000  # an SM clock, in MHz
    from cpkv.timeline import sm_clock_mhz
    assert 100 <= sm_clock_mhz() <= 5000


def test_rows_put_the_gpu_on_the_host_clock_through_the_sync_point():
    """A chained batch: the host began it 40 ms after the chain's synchronisation, while the GPU still ran the batch
    before. Its marks' GPU times come from the synchronisation event (ms on the GPU clock) mapped onto the host's
    clock, from the batch's host start: a mark the GPU ran 45 ms after the sync is 5 ms after that start; the host
    issued it 1 ms after the start, so the GPU was 4 ms behind (not 'waiting'). gpu_start_ms puts the rows'
    origin on the process's GPU clock (the anchor: 100 ms before the sync)."""
    from cpkv.timeline import Recorder

    class Ev:
        def __init__(self, at: float):
            self.at = at

        def elapsed_time(self, other: "Ev") -> float:
            return other.at - self.at

    rec = object.__new__(Recorder)
    sync_ev, anchor = Ev(1000.0), Ev(900.0)
    rec._t0, rec._sync, rec._anchor, rec._start = 10.040, (10.0, sync_ev), anchor, Ev(1045.0)
    rec._marks = [("L0 project", 10.041, Ev(1045.0), None), ("L0 mlp", 10.050, Ev(1051.0), None)]
    assert rec.rows() == [("L0 project", 1.0, 5.0), ("L0 mlp", 10.0, 11.0)]
    assert rec.gpu_start_ms() == 140.0  # 100 ms from the anchor to the sync, + 40 ms to the host start
    stats = {"batch_s": [0.05], "marks": [{"unix_start": 0.0, "gpu_start_ms": 140.0, "rows": rec.rows()}]}
    assert marks_of(stats, [0])["gpu_waits_for_host_until_ms"] == 0.0

"""The memory-site diagnostic's summary (``engine.memsites.sites``) over a hand-made snapshot: live blocks summed by
their innermost cpkv frames, freed ones left out, largest first."""
from __future__ import annotations

from cpkv.engine.memsites import sites


def _blk(size, state, *files):
    return {"size": size, "state": state, "frames": [{"filename": f, "line": i, "name": "fn"} for i, f in enumerate(files)]}


def test_sites_sum_live_blocks_by_cpkv_frames():
    snap = {"segments": [{"blocks": [
        _blk(100, "active_allocated", "/x/torch/nn.py", "/s/cpkv/model/linear.py", "/s/cpkv/model/layer.py"),
        _blk(50, "active_allocated", "/x/torch/nn.py", "/s/cpkv/model/linear.py", "/s/cpkv/model/layer.py"),
        _blk(400, "inactive", "/s/cpkv/kvcache/pool.py"),
        _blk(70, "active_allocated", "/s/cpkv/kvcache/pool.py"),
        _blk(5, "active_allocated", "/x/torch/other.py"),
    ]}]}
    got = sites(snap)
    assert [r["bytes"] for r in got] == [150, 70, 5]
    assert got[0]["site"] == "linear.py:1 fn < layer.py:2 fn" and got[0]["blocks"] == 2
    assert got[1]["site"] == "pool.py:0 fn" and got[2]["site"] == "?"

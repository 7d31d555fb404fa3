"""The engine's host-tier reload must not overwrite a page a slower peer still gathers for the last batch.

With this trace at cp 3 (12 pool pages per rank, a host tier), batch 2 composes a1 over a0's cached pages,
rank 1's page 5 among them; right after it, b1's chain (b0's pages) comes back from the host tier, evicting
a0's pages and loading b0's into them, page 5 included. ``symm`` gathers after a batch's last barrier round,
which the owner has passed as well, so the owner may reload before a peer's last gather is done. Rank 0
(it holds a1's last token) is made slow there: its last-layer gather of batch 2 waits until rank 1's page 5
changes, or 3 s. Without the reload's opening group barrier it reads b0's bytes in place of a0's and a1's
logits go wrong; with it, rank 1 waits for rank 0 and every request matches the single-process reference.
"""
from __future__ import annotations

import time

import pytest

from cpkv.dist import launch
from cpkv.engine.config import EngineConfig
from cpkv.engine.engine import merge, verify_run
from cpkv.scheduler.trace import TraceRequest

pytestmark = pytest.mark.slow

TRACE = [TraceRequest("a0", 0.0, 256, None, None), TraceRequest("b0", 0.0, 400, None, None),
         TraceRequest("b1", 0.0, 416, None, "b0"), TraceRequest("a1", 0.0, 272, None, "a0")]
CFG = EngineConfig(page_size=16, pages_per_rank=12, chunk_size=512, max_requests=4, cp=3, host_pages=48,
                   mode="symm")
BATCH, OWNER, READER, PAGE = 2, 1, 0, 5
WAIT_S = 3.0


def _worker(ctx, job):
    """Run ``job`` unfenced, then fenced, with rank READER's last gather of batch BATCH held back; per run
    (rank output, loads of the last batch's own prefix pages, whether the reader saw the page change)."""
    from cpkv.compose.runtime import ComposeRuntime
    from cpkv.engine import rank as rank_mod
    from cpkv.kvcache.host import HostTier

    state = {"batch": -1, "prefix": set(), "hazard": [], "changed": False, "fenced": False}
    run_batch, fence, load, gather = (rank_mod.RankEngine._run_batch, rank_mod.RankEngine._fence_reload,
                                      HostTier.load, ComposeRuntime.gather)

    def tracked_batch(self, batch):
        state["batch"] = self.batches
        lay = batch.layout(self.model.cfg.max_context)
        done = run_batch(self, batch)
        state["prefix"] = {p.page_id for p in lay.logical_pages if p.kind == "prefix" and p.rank == self.rank}
        return done

    def tracked_load(self, slots, pages):
        state["hazard"] += sorted(set(pages) & state["prefix"])
        return load(self, slots, pages)

    def slow_gather(rt, out, table, layer, kind, half, e):
        if (rt.rank == READER and state["batch"] == BATCH and layer == rt.num_layers - 1 and table == "global"
                and kind == "token"):
            page = rt.pools[kind][OWNER][rt.pool.slot(layer, kind)][PAGE]
            before, end = page.clone(), time.monotonic() + WAIT_S
            while bool((page == before).all()) and time.monotonic() < end:
                time.sleep(0.005)
            state["changed"] = not bool((page == before).all())
        return gather(rt, out, table, layer, kind, half, e)

    rank_mod.RankEngine._run_batch = tracked_batch
    rank_mod.RankEngine._fence_reload = lambda self: fence(self) if state["fenced"] else None
    HostTier.load = tracked_load
    ComposeRuntime.gather = slow_gather
    runs = []
    for fenced in (False, True):
        state.update(batch=-1, prefix=set(), hazard=[], changed=False, fenced=fenced)
        out = rank_mod.rank_main(ctx, [job])[0]
        runs.append((out, list(state["hazard"]), state["changed"]))
    return runs


def test_a_reload_never_overwrites_a_page_a_slow_peer_still_reads():
    per_rank = launch(_worker, CFG.cp, args=((CFG, TRACE),), timeout_s=300)
    for i, fenced in enumerate((False, True)):
        res = merge(CFG, TRACE, [per_rank[r][i][0] for r in range(CFG.cp)])
        assert PAGE in per_rank[OWNER][i][1]  # the owner reloads into its prefix page of the batch just done
        assert res.summary["pages_reloaded"] > 0 and not res.rejected
        rep = verify_run(res, TRACE)
        assert rep.checked == len(TRACE)
        if fenced:
            assert not per_rank[READER][i][2]  # the owner waited for the slow reader
            assert rep.ok and rep.tokens_equal, rep
        else:
            assert per_rank[READER][i][2]  # the reader's gather saw the reloaded bytes
            assert not rep.ok and rep.worst == "a1", rep

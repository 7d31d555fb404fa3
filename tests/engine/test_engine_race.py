"""The engine's host-tier reload must not overwrite a page a slower peer still gathers for the last batch.

With this trace at cp 3 (12 pool pages per rank, a host tier), batch 2 composes a1 over a0's cached pages,
rank 1's page 5 among them; right after it, b1's chain (b0's pages) comes back from the host tier, evicting
a0's pages and loading b0's into them, page 5 included. ``symm`` gathers after a batch's last barrier round,
which the owner has passed as well, so the owner may reload before a peer's last gather is done. Rank 0
(it holds a1's last token) is held back there, its last-layer gather of batch 2 waiting on events, never
on a clock (marker files in a folder the ranks share). Without the reload's opening group barrier, rank 1's
first reload waits until rank 0 holds its gather (so the race happens whatever the machine's load: the
reload can no longer come before the gather starts), rank 0 waits until page 5 changes and reads b0's bytes
in place of a0's, and a1's logits go wrong. With the barrier, rank 0 waits until rank 1 has reached it
(rank 1 marks its way in), where rank 1 stays until rank 0 arrives: page 5 is unchanged and every request
matches the single-process reference. ``WAIT_S`` only bounds a wait that a correct engine never reaches.
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
# one (dense) layer: the last layer's compose gather is then the batch's last group interaction. (Under expert
# parallelism a last MoE layer's exchange takes two more barrier rounds after it, which would hold the owner
# back by themselves and hide the hazard this test provokes.)
CFG = EngineConfig(page_size=16, pages_per_rank=12, chunk_size=512, max_requests=4, cp=3, host_pages=48,
                   mode="symm", num_layers=1)
BATCH, OWNER, READER, PAGE = 2, 1, 0, 5
WAIT_S = 120.0
MARKER = "owner-at-fence"


def _worker(ctx, job, marks):
    """Run ``job`` unfenced, then fenced, with rank READER's last gather of batch BATCH held back; per run
    (rank output, loads of the last batch's own prefix pages, whether the reader saw the page change).
    ``marks``: a folder the ranks share; OWNER writes MARKER there on its way into the fenced reload barrier."""
    import os

    from cpkv.compose.runtime import ComposeRuntime
    from cpkv.engine import rank as rank_mod
    from cpkv.engine.executor import BatchExecutor
    from cpkv.kvcache.host import HostTier

    state = {"batch": -1, "prefix": set(), "hazard": [], "changed": False, "fenced": False, "owner_done": False}
    run_batch, fence, load, gather = (BatchExecutor.run, BatchExecutor._fence_reload, HostTier.load,
                                      ComposeRuntime.gather)
    marker = os.path.join(marks, MARKER)

    def tracked_batch(self, batch, *args, **kwargs):
        state["batch"] = self.batches
        lay = batch.layout(self.model.cfg.max_context)
        done = run_batch(self, batch, *args, **kwargs)
        state["prefix"] = {p.page_id for p in lay.logical_pages if p.kind == "prefix" and p.rank == self.rank}
        return done

    def tracked_load(self, slots, pages):
        state["hazard"] += sorted(set(pages) & state["prefix"])
        return load(self, slots, pages)

    def wait_for(path: str) -> bool:
        end = time.monotonic() + WAIT_S
        while not os.path.exists(path) and time.monotonic() < end:
            time.sleep(0.005)
        return os.path.exists(path)

    def tracked_fence(self):
        if self.rank != OWNER or state["batch"] < BATCH or state["owner_done"]:
            return fence(self) if state["fenced"] else None
        state["owner_done"] = True
        if not state["fenced"]:  # the race, forced: the first reload waits until the reader holds its gather
            wait_for(f"{marker}.reader-holds-{state['fenced']}")
            return None
        open(marker, "w").close()  # the owner now waits in the group barrier until the reader comes
        return fence(self)

    def held_back(page) -> bool:
        """Wait for the event of this run: the page changing (unfenced) or the owner in its fence (fenced)."""
        before, end = page.clone(), time.monotonic() + WAIT_S
        open(f"{marker}.reader-holds-{state['fenced']}", "w").close()
        while time.monotonic() < end:
            if not bool((page == before).all()) or (state["fenced"] and os.path.exists(marker)):
                break
            time.sleep(0.005)
        return not bool((page == before).all())

    def slow_gather(rt, out, table, layer, kind, half, e):
        if (rt.rank == READER and state["batch"] == BATCH and layer == rt.num_layers - 1 and table == "global"
                and kind == "token"):
            state["changed"] = held_back(rt.pools[kind][OWNER][rt.pool.slot(layer, kind)][PAGE])
        return gather(rt, out, table, layer, kind, half, e)

    BatchExecutor.run = tracked_batch
    BatchExecutor._fence_reload = tracked_fence
    HostTier.load = tracked_load
    ComposeRuntime.gather = slow_gather
    runs = []
    for fenced in (False, True):
        state.update(batch=-1, prefix=set(), hazard=[], changed=False, fenced=fenced, owner_done=False)
        out = rank_mod.rank_main(ctx, [job])[0]
        runs.append((out, list(state["hazard"]), state["changed"]))
    return runs


def test_a_reload_never_overwrites_a_page_a_slow_peer_still_reads(tmp_path):
    per_rank = launch(_worker, CFG.cp, args=((CFG, TRACE), str(tmp_path)), timeout_s=600)
    for i, fenced in enumerate((False, True)):
        res = merge(CFG, TRACE, [per_rank[r][i][0] for r in range(CFG.cp)])
        assert PAGE in per_rank[OWNER][i][1]  # the owner reloads into its prefix page of the batch just done
        assert res.summary["pages_reloaded"] > 0 and not res.rejected
        rep = verify_run(res, TRACE)
        assert rep.checked == len(TRACE)
        if fenced:
            assert (tmp_path / MARKER).exists()  # the owner reached its fence while the reader was held back
            assert not per_rank[READER][i][2]  # ... and waited there for the slow reader
            assert rep.ok and rep.tokens_equal, rep
        else:
            assert per_rank[READER][i][2]  # the reader's gather saw the reloaded bytes
            assert not rep.ok and rep.worst == "a1", rep

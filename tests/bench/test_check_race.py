"""The check's cross-batch page race, made deterministic (the cp 2 ``symm`` soak mismatches).

Seed 15's batch 0 reads rank 1's pool page 128 as a prefix page; batch 1 gives rank 1 that page as a current
page, which ``_run_mode`` scribbles over before composing. Rank 0 is made slow at the suspected point: its
index-row gather of batch 0 (its last read of the batch, after the batch's last barrier round) waits until
rank 1 has scribbled the page, or 3 s. Without the batch-start barrier rank 1 gets there and rank 0 reads the
scribble: exactly the page's bytes that differ from the scribble value are wrong, as in the soak (batch
875: 3 slots x 2103 bytes of one index page = 6309). With it rank 1 waits for rank 0 and every byte matches.
"""
from __future__ import annotations

import time

import pytest

from cpkv.bench import check
from cpkv.bench.check import SCRIBBLE, CheckConfig, draw_batch, initial_pool
from cpkv.config import preset
from cpkv.dist import launch

SEED, BATCH, PAGE = 15, 0, 128
WAIT_S = 3.0


def _slow_rank0_worker(ctx, cfg: CheckConfig, fenced: bool):
    """``check.rank_worker`` with rank 0's batch-``BATCH`` index gather held back (and, unfenced, without the
    batch-start barrier)."""
    from cpkv.compose.runtime import ComposeRuntime

    batch = {"b": -1}
    draw = check.draw_batch

    def counting_draw(c, b):
        batch["b"] = b
        return draw(c, b)

    gather = ComposeRuntime.gather

    def slow_gather(rt, out, table, layer, kind, half, e):
        if rt.rank == 0 and kind == "index" and table == "global" and batch["b"] == BATCH:
            page = rt.pools["index"][1][rt.pool.slot(layer, kind)][PAGE]
            end = time.monotonic() + WAIT_S
            while not bool((page == SCRIBBLE).all()) and time.monotonic() < end:
                time.sleep(0.005)
        return gather(rt, out, table, layer, kind, half, e)

    check.draw_batch = counting_draw
    ComposeRuntime.gather = slow_gather
    if not fenced:
        check._fence_batch = lambda ctx, rt: None
    return check.rank_worker(ctx, cfg)


def _expected_wrong_bytes(cfg: CheckConfig) -> int:
    """Bytes rank 0 gets wrong when it reads rank 1's scribbled index page in batch ``BATCH``."""
    model = preset(cfg.model).with_layers(cfg.layers)
    layout, _ = draw_batch(cfg, BATCH)
    slots = sum(1 for p in layout.logical_pages if p.kind == "prefix" and (p.rank, p.page_id) == (1, PAGE))
    nxt, ids = draw_batch(cfg, BATCH + 1)
    assert slots and (1, PAGE) in {(c.writer, ids[c.compact]) for c in nxt.current_pages}  # the hazard exists
    page = initial_pool(cfg, model, 1, "index")[0, PAGE]  # batch 0: the page still holds its initial bytes
    return slots * int((page != SCRIBBLE).sum())


@pytest.mark.parametrize("fenced", [False, True], ids=["no-barrier", "barrier"])
def test_a_slow_peer_never_reads_pages_scribbled_for_the_next_batch(fenced):
    cfg = CheckConfig(cp=2, modes=("symm",), batches=2, seed=SEED, layers=1, timeout_s=120)
    results = launch(_slow_rank0_worker, 2, args=(cfg, fenced), timeout_s=120)
    wrong = [r["modes"]["symm"]["mismatches"] for r in results]
    assert [r["modes"]["symm"]["batches"] for r in results] == [2, 2]
    if fenced:
        assert wrong == [0, 0]
    else:
        assert wrong == [_expected_wrong_bytes(cfg), 0]

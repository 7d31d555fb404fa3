"""A decode step's rank plan (``engine.decode.decode_plan``) over the device page table: exact ids, positions, pool
rows of the new tokens, key ranges, and the context map (owner, row) of every key, from the table's changes alone."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from cpkv.engine.decode import DecodeTable, decode_plan
from cpkv.scheduler.decode import DecodeEntry, DecodeStep

P = 4
MODEL = SimpleNamespace(device=torch.device("cpu"), cfg=SimpleNamespace(index_topk=6))


def _entry(rid, slot, pages, position, changes=None):
    o, p = pages[position // P]
    ch = tuple((i, *pg) for i, pg in enumerate(pages)) if changes is None else changes
    return DecodeEntry(rid, 100 + slot, position, o, p, slot, ch)


def _want(pages, context):
    return [(pages[j // P][0], pages[j // P][1] * P + j % P) for j in range(context)]


def test_the_context_map_follows_each_entrys_page_table_and_its_changes():
    a = [(0, 5), (1, 2), (0, 9)]          # 3 pages, the token at position 9 (page 2 on rank 0)
    b = [(1, 7), (1, 8)]                  # the token at position 4 (page 1 on rank 1)
    c = [(0, 3)]                          # the token at position 0
    table = DecodeTable(8, torch.device("cpu"))
    step = DecodeStep(0, (_entry("a", 2, a, 9), _entry("b", 0, b, 4), _entry("c", 5, c, 0)), P, 2)
    table.apply(step)
    plan = decode_plan(step, 0, MODEL, table)
    assert plan.rids == ("a", "c")
    assert plan.ids.tolist() == [102, 105] and plan.positions.tolist() == [9, 0]
    assert plan.write_rows.tolist() == [9 * P + 1, 3 * P]
    assert plan.attn.ks.tolist() == [0, 10] and plan.attn.ke.tolist() == [10, 11] and plan.attn.dense is False
    got = list(zip(plan.ctx.owner.tolist(), plan.ctx.row.tolist()))
    assert got == _want(a, 10) + _want(c, 1)
    one = decode_plan(step, 1, MODEL, table)
    assert one.rids == ("b",) and list(zip(one.ctx.owner.tolist(), one.ctx.row.tolist())) == _want(b, 5)
    assert one.attn.dense is True  # 5 keys <= top-k 6
    # the next step: a's generation moved on a page (one change), c's unchanged (none)
    a2 = a + [(1, 4)]
    step2 = DecodeStep(1, (_entry("a", 2, a2, 12, ((3, 1, 4),)), _entry("c", 5, c, 1, ())), P, 2)
    table.apply(step2)
    assert decode_plan(step2, 1, MODEL, table).rids == ("a",)
    plan2 = decode_plan(step2, 1, MODEL, table)
    assert list(zip(plan2.ctx.owner.tolist(), plan2.ctx.row.tolist())) == _want(a2, 13)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_without_entries_plans_nothing(rank):
    table = DecodeTable(4, torch.device("cpu"))
    step = DecodeStep(0, (_entry("x", 0, [(1 - rank, 1)], 2),), P, 2)
    table.apply(step)
    plan = decode_plan(step, rank, MODEL, table)
    assert plan.num_tokens == 0 and plan.ctx.row.numel() == 0 and plan.ids.numel() == 0

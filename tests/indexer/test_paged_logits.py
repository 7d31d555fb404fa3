"""The decode logits over paged index rows on the CPU: paged_mqa_logits_ref is mqa_logits_ref over each
generation's context gathered by hand (bit for bit), the dispatch runs it off CUDA, bad inputs are named."""
from __future__ import annotations

import pytest
import torch

from cpkv.errors import IndexerError
from cpkv.indexer import dequantize_index_rows, mqa_logits_ref, quantize_index_keys, quantize_queries
from cpkv.indexer.paged import paged_logits
from cpkv.kernels.mqa_logits.ref import paged_mqa_logits_ref

P = 8


def _inputs(ctx, H=4, D=32, cp=3, pages=12, seed=0):
    g = torch.Generator().manual_seed(seed)
    pools = [quantize_index_keys(torch.randn(pages * P, D, generator=g)) for _ in range(cp)]
    B, max_pages = len(ctx), 6
    slot = torch.randperm(B + 2, generator=g)[:B]
    owner = torch.randint(0, cp, (B + 2, max_pages), generator=g)
    page = torch.randint(0, pages, (B + 2, max_pages), generator=g)
    q, w = quantize_queries(torch.randn(B, H, D, generator=g), torch.randn(B, H, generator=g))
    return q, w, pools, owner, page, slot, torch.tensor(ctx)


def _by_hand(q, w, pools, owner, page, slot, ctx, L):
    """Each generation's keys gathered position by position, then mqa_logits_ref over exactly those keys."""
    out = torch.full((q.shape[0], L), float("-inf"))
    for b, n in enumerate(ctx.tolist()):
        sl = int(slot[b])
        rows = torch.stack([pools[int(owner[sl, s // P])][int(page[sl, s // P]) * P + s % P] for s in range(n)]) \
            if n else torch.zeros(0, q.shape[2] + 4, dtype=torch.uint8)
        k, k_scale = dequantize_index_rows(rows)
        zero, end = torch.zeros(1, dtype=torch.int32), torch.tensor([n], dtype=torch.int32)
        out[b, :n] = mqa_logits_ref(q[b:b + 1], k, k_scale, w[b:b + 1], zero, end)[0]
    return out


@pytest.mark.parametrize("ctx,L", [([0, 5, 37], 48), ([48], 48), ([1, 8, 9, 16, 17], 20), ([0], 8)])
def test_ref_is_mqa_logits_over_the_gathered_context(ctx, L):
    args = _inputs(ctx)
    got = paged_mqa_logits_ref(*args, P, L)
    assert got.shape == (len(ctx), L) and got.dtype == torch.float32
    assert torch.equal(got, _by_hand(*args, L))  # bit for bit: each entry is independent of the other keys
    for b, n in enumerate(ctx):
        assert bool(torch.isinf(got[b, n:]).all()) and bool(torch.isfinite(got[b, :n]).all())


def test_ref_reads_no_table_entry_past_the_context():
    q, w, pools, owner, page, slot, ctx = _inputs([5, 20])
    want = paged_mqa_logits_ref(q, w, pools, owner, page, slot, ctx, P, 24)
    for b, n in enumerate(ctx.tolist()):
        owner[slot[b], -(-n // P):] = 1 << 30
        page[slot[b], -(-n // P):] = -(1 << 40)
    assert torch.equal(paged_mqa_logits_ref(q, w, pools, owner, page, slot, ctx, P, 24), want)


def test_ref_sees_a_wrong_page_and_a_wrong_owner():
    q, w, pools, owner, page, slot, ctx = _inputs([0, 5, 37])
    want = paged_mqa_logits_ref(q, w, pools, owner, page, slot, ctx, P, 40)
    sl = int(slot[2])
    for tab, new in ((page, (page[sl, 3] + 1) % 12), (owner, (owner[sl, 3] + 1) % 3)):
        old = tab[sl, 3].clone()
        tab[sl, 3] = new
        got = paged_mqa_logits_ref(q, w, pools, owner, page, slot, ctx, P, 40)
        tab[sl, 3] = old
        assert not torch.equal(got[2, 24:32], want[2, 24:32]) and torch.equal(got[:2], want[:2])


def test_dispatch_runs_the_reference_off_cuda():
    q, w, pools, owner, page, slot, ctx = _inputs([0, 5, 37])
    out = torch.full((3, 40), 7.0)
    bases = torch.tensor([p.data_ptr() for p in pools])  # given, but the CPU's backends are the references
    assert paged_logits(q, w, pools, bases, owner, page, slot, ctx, P, out) is out
    assert torch.equal(out, paged_mqa_logits_ref(q, w, pools, owner, page, slot, ctx, P, 40))


def test_dispatch_names_bad_inputs():
    q, w, pools, owner, page, slot, ctx = _inputs([0, 5, 37])
    out = torch.empty(3, 40)
    good = dict(q=q, weights=w, pools=pools, bases=None, owner_tab=owner, page_tab=page, slot=slot, ctx=ctx,
                page_size=P, out=out)
    bad = {"q must be float8": dict(q=q.float()), "weights must be": dict(weights=w[:, :2]),
           "slot must be": dict(slot=slot.int()), "ctx must be": dict(ctx=ctx[:2]),
           "owner_tab and page_tab": dict(page_tab=page[:, :3]), "power of two": dict(page_size=6),
           "out must be": dict(out=out.double()), "pool 1 must be": dict(pools=[pools[0], pools[1][:, :20]]),
           "pool 0 must be uint8 \\[pages": dict(pools=[pools[0][:-1], pools[1]]),
           "none given": dict(pools=[])}
    for message, change in bad.items():
        with pytest.raises(IndexerError, match=message):
            paged_logits(**dict(good, **change))

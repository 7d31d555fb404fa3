"""Full and shared indexer layers in the KV machinery, and the MoE block's two expert paths."""
from __future__ import annotations

import pytest
import torch

from cpkv.config import preset
from cpkv.errors import ComposeError
from cpkv.kvcache.pool import KVPool
from cpkv.model.moe import experts, experts_loop, route

TINY = preset("tiny")  # layers: full, shared, full


def test_shared_layers_hold_no_index_rows():
    pool = KVPool(TINY, num_pages=6, page_size=4)
    assert pool.buffers["token"].shape[0] == 3 and pool.buffers["index"].shape[0] == 2
    assert pool.slot(2, "index") == 1 and pool.kinds_at(1) == ("token",)
    with pytest.raises(ComposeError, match="layer 1 keeps no index rows"):
        pool.rows(1, "index")
    assert pool.next_layer["index"] == {0: 2, 2: None}
    glm = KVPool(preset("glm5"), num_pages=2, page_size=1, num_layers=4, alloc=lambda shape, name: torch.empty(shape))
    assert glm.buffers["index"].shape[0] == 3  # F F S F
    assert pool.nbytes() == 6 * 4 * (3 * TINY.row_bytes("token") + 2 * TINY.row_bytes("index"))


def test_exact_rows_are_unquantised():
    import dataclasses
    exact = dataclasses.replace(TINY, kv_dtype="float32")
    assert exact.row_bytes("token") == 4 * (128 + 32) and exact.row_bytes("index") == 4 * 64
    assert TINY.row_bytes("token") == 128 + 4 + 64 and TINY.row_bytes("index") == 64 + 4


@pytest.mark.parametrize("t", [1, 7, 64])
def test_grouped_experts_equal_the_loop(t):
    g = torch.Generator().manual_seed(t)
    e, d, i = TINY.n_routed_experts, TINY.hidden_size, TINY.moe_intermediate_size
    x = torch.randn(t, d, generator=g)
    gate_up = torch.randn(e, 2 * i, d, generator=g) / d ** 0.5
    down = torch.randn(e, d, i, generator=g) / i ** 0.5
    idx, w = route(x, torch.randn(e, d, generator=g), 0.1 * torch.randn(e, generator=g), TINY)
    assert idx.shape == (t, 2) and torch.allclose(w.sum(-1), torch.full((t,), TINY.routed_scaling_factor))
    groups = idx // (e // TINY.n_group)
    assert torch.equal(groups[:, 0], groups[:, 1])  # topk_group 1: both experts from the one best group
    torch.testing.assert_close(experts(x, idx, w, gate_up, down), experts_loop(x, idx, w, gate_up, down),
                               rtol=1e-5, atol=1e-5)


def test_cost_model_counts_index_rows_on_full_layers_only():
    from cpkv.scheduler.costs import CostModel

    assert CostModel().kv_bytes_per_token == preset("glm5").kv_bytes_per_token() == 78 * 656 + 40 * 132

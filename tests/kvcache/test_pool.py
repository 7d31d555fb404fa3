from __future__ import annotations

import pytest
import torch

from cpkv.config import preset
from cpkv.errors import ComposeError
from cpkv.kvcache import HostTier, KVPool
from cpkv.kvcache.pool import field_views, page_row_ids


@pytest.mark.parametrize("name", ["glm5", "tiny"])
@pytest.mark.parametrize("kind", ["token", "index"])
def test_fp8_rows_round_trip_through_uint8(name, kind):
    model = preset(name)
    pool = KVPool(model, num_pages=6, page_size=4, num_layers=3)
    layer, other = pool.model.layers_of(kind)[1], pool.model.layers_of(kind)[0]  # index rows: full layers only
    fmt = model.row_format(kind)
    g = torch.Generator().manual_seed(0)
    n = 7
    vals = (torch.rand(n, fmt.fp8_bytes, generator=g) * 400 - 200).to(torch.float8_e4m3fn)
    scales = torch.rand(n, fmt.scale_count, generator=g) + 0.1
    src = torch.zeros(n, fmt.row_bytes, dtype=torch.uint8)
    v, s, r = field_views(src, fmt)
    v.copy_(vals)
    s.copy_(scales)
    if r is not None:
        r.copy_(torch.randn(n, fmt.rope_dims, generator=g).to(torch.bfloat16))
    rows = torch.tensor(page_row_ids([2, 5], 4, [4, 3]))
    pool.write_rows(layer, kind, rows, src)
    back = pool.rows(layer, kind)[rows]
    assert torch.equal(back, src)
    bv, bs, _ = field_views(back, fmt)
    assert torch.equal(bv.view(torch.uint8), vals.view(torch.uint8))
    assert torch.equal(bs, scales)
    assert pool.pages(other, kind).abs().sum() == 0  # other layer untouched


def test_wrong_row_size_is_named():
    pool = KVPool(preset("tiny"), num_pages=4, page_size=2, num_layers=1)
    with pytest.raises(ComposeError, match="uint8 \\[n, 196\\]"):
        pool.write_rows(0, "token", torch.tensor([2]), torch.zeros(1, 68, dtype=torch.uint8))


def test_host_tier_round_trip():
    pool = KVPool(preset("tiny"), num_pages=8, page_size=2, num_layers=2)
    for b in pool.buffers.values():
        b.random_(0, 256, generator=torch.Generator().manual_seed(1))
    host = HostTier(pool, host_pages=4)
    before = {k: v.clone() for k, v in pool.buffers.items()}
    host.offload([3, 4, 6], [1, 2, 3])
    host.load([1, 2, 3], [7, 1, 2])
    host.synchronize()
    for k in pool.buffers:
        assert torch.equal(pool.buffers[k][:, [7, 1, 2]], before[k][:, [3, 4, 6]])

"""GPU: every kernel entry at prompt lengths past CUDA's grid-y limit (65,535) and key counts >= 2^17.

Each test runs one entry at T = 65,537 query rows or more (or that many entries / rows) and S >= 2^17
keys, against the pure-torch reference on the same device:
  - bytes and indices (token-KV and index quantisation, page gather, top-k) exactly equal;
  - sparse MLA against a float32 reference over EVERY row (so every program's token and head block is
    checked): relative error <= 1e-2, max abs error <= 1e-2 * max |ref|, lse within 1e-3 + 1e-5 |ref|,
    rows with no valid key exactly out 0 / lse +inf (assert_close_attention);
  - MQA logits: the long launch equal bit for bit to short launches of the same rows, and those within
    2e-3 of each row's largest |logit| of the float64 reference, -inf positions equal; the chunked logits + top-k over a plan's work items checked per sampled row: k distinct valid
    indices whose float64 logits are at least every unselected key's (to 2e-3 of the row's scale).
They use a few GB of device memory each; marked ``cuda``, skipped without CUDA or Triton.
"""
from __future__ import annotations


import pytest
import torch

from cpkv.attention import dense_causal_mla, dequant_token_kv, quant_token_kv
from cpkv.attention.ref import GLM5_TOKEN, dense_indices, dequant_token_kv_ref, quant_token_kv_ref, sparse_mla_ref
from cpkv.indexer import (
    IndexerPlan, dequantize_index_rows, index_topk, mqa_logits, mqa_logits_ref, quantize_index_keys, quantize_queries,
    topk, topk_ref,
)
import sys, pathlib  # noqa: E401,E402
sys.path[:0] = [str(pathlib.Path(__file__).resolve().parents[1] / d) for d in ("attention", "indexer")]
from test_attention import assert_close_attention  # noqa: E402
from test_indexer_gpu import _assert_logits_close  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)

T_LONG = 65_537  # one more query row than CUDA allows in grid dimension y
S_LONG = (1 << 17) + 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cuda").manual_seed(seed)


def _sparse_inputs(t: int, h: int, s: int, topk: int, seed: int):
    g = _gen(seed)
    q = torch.randn(t, h, 576, generator=g, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(s, 576, generator=g, device="cuda", dtype=torch.bfloat16)
    idx = torch.randint(0, s, (t, topk), generator=g, device="cuda", dtype=torch.int32)
    junk = torch.rand(t, topk, generator=g, device="cuda") < 0.1
    bad = torch.where(torch.rand(t, topk, generator=g, device="cuda") < 0.5, -1, s + 7).to(torch.int32)
    idx = torch.where(junk, bad, idx)
    idx[t // 2] = -1  # a row with no valid key
    idx[-1] = torch.arange(s - topk, s, device="cuda", dtype=torch.int32)  # the last rows of kv, last query
    return q, kv, idx


def _assert_close_every_row(out, lse, q, kv, idx, sm_scale: float, rows: int = 8192) -> None:
    """assert_close_attention against the float32 reference, ``rows`` query rows at a time (bounded memory)."""
    for t0 in range(0, q.shape[0], rows):
        r = slice(t0, t0 + rows)
        ref_out, ref_lse = sparse_mla_ref(q[r], kv, idx[r], sm_scale, 512, dtype=torch.float32, chunk=2048)
        assert_close_attention(out[r], lse[r], ref_out, ref_lse, lse_atol=1e-3)


def _sparse_config(name: str):
    from cpkv.kernels.sparse_mla import triton as kernel

    if name == "gluon_ws":
        if not kernel.gluon_supported(512, 64, torch.cuda.get_device_capability()):
            pytest.skip("the Gluon kernel needs sm_90 and triton.experimental.gluon")
        return kernel.GLUON_WS
    return kernel.Config(64, 64, 8, 2)


@pytest.mark.parametrize("path,h", [("gluon_ws", 96), ("triton", 80)])
def test_sparse_mla_past_grid_y(path: str, h: int) -> None:
    # h = 96 / 80: two head blocks, the second partial, so the flat grid's (token, head block) split is exercised
    from cpkv.kernels.sparse_mla import triton as kernel

    cfg = _sparse_config(path)
    q, kv, idx = _sparse_inputs(T_LONG, h, S_LONG, 64, seed=h)
    out, lse, _ = kernel.launch(q, kv, idx, None, None, 0.05, 512, cfg)
    _assert_close_every_row(out, lse, q, kv, idx, 0.05)


def test_dense_causal_mla_past_grid_y() -> None:
    # the dense path of the default kernel (Gluon on sm_90): query t reads kv rows [ks[t], ke[t])
    g = _gen(3)
    t, s = T_LONG, S_LONG
    q = torch.randn(t, 64, 576, generator=g, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(s, 576, generator=g, device="cuda", dtype=torch.bfloat16)
    ke = (torch.arange(t, device="cuda", dtype=torch.int64) * (s - 1) // (t - 1) + 1).to(torch.int32)
    ks = (ke - torch.randint(0, 150, (t,), generator=g, device="cuda", dtype=torch.int32)).clamp(min=0)
    ks[5] = ke[5]  # no key
    out, lse = dense_causal_mla(q, kv, ks, ke, 0.05)
    _assert_close_every_row(out, lse, q, kv, dense_indices(ks, ke), 0.05)


def _logits_inputs(t: int, h: int, s: int, seed: int):
    g = _gen(seed)
    q, w = quantize_queries(torch.randn(t, h, 128, device="cuda", generator=g), torch.randn(t, h, device="cuda", generator=g))
    k, k_scale = dequantize_index_rows(quantize_index_keys(torch.randn(s, 128, device="cuda", generator=g)))
    return q, k, k_scale, w


@pytest.mark.parametrize("variant,h,t", [("default", 32, 262_147), ("gluon_span3", 32, T_LONG),
                                         ("lanes", 64, 131_075)])
def test_logits_grid_past_grid_y(variant: str, h: int, t: int) -> None:
    # token groups of 128 // h rows: 65,537 groups (default, H = 32) and 65,538 (lanes, H = 64) in the old grid's y.
    # Blocks of 128 rows (whole token groups) launched alone must give the long launch's logits bit for bit, and
    # those blocks match the float64 reference (over all 262,147 rows, fp8 accumulation puts a few rows with a
    # cancelling head sum past the per-row tolerance, so the reference is checked on the blocks)
    from cpkv.kernels.mqa_logits.config import LogitsConfig

    cfg = {"default": None, "gluon_span3": LogitsConfig(gluon_span=3),
           "lanes": LogitsConfig(variant="lanes", tma=False)}[variant]
    s = 300
    q, k, k_scale, w = _logits_inputs(t, h, s, seed=t)
    g = _gen(1)
    ks = torch.randint(0, s // 2, (t,), generator=g, device="cuda", dtype=torch.int32)
    ke = (ks + torch.randint(0, s, (t,), generator=g, device="cuda", dtype=torch.int32)).clamp(max=s).int()
    out = mqa_logits(q, k, k_scale, w, ks, ke, config=cfg)
    for r in (0, t // 2, 65_535, t - 1):
        a = r // 128 * 128
        b = min(a + 128, t)
        short = mqa_logits(q[a:b], k, k_scale, w[a:b], ks[a:b], ke[a:b], config=cfg)
        assert torch.equal(out[a:b], short), f"rows {a}..{b - 1} differ from a short launch"
        _assert_logits_close(short, mqa_logits_ref(q[a:b], k, k_scale, w[a:b], ks[a:b], ke[a:b], dtype=torch.float64))


def test_logits_many_keys() -> None:
    # S >= 2^17 keys, every row sees most of them (the grid's span axis: 33 spans of 4096 columns)
    t, s = 40, S_LONG
    q, k, k_scale, w = _logits_inputs(t, 32, s, seed=2)
    ks = torch.randint(0, 1000, (t,), generator=_gen(4), device="cuda", dtype=torch.int32)
    ke = torch.full((t,), s, device="cuda", dtype=torch.int32) - ks
    out = mqa_logits(q, k, k_scale, w, ks, ke)
    _assert_logits_close(out, mqa_logits_ref(q, k, k_scale, w, ks, ke, dtype=torch.float64))


def test_index_topk_long_prompt_work_items() -> None:
    # chunked logits over the plan's work items (unclean, the default path) + top-k, T = 65,537 rows over
    # S >= 2^17 keys, each row a window of ~3,000 keys sliding along the keys
    t, s, topk_k, width = T_LONG, S_LONG, 2048, 3000
    q, k, k_scale, w = _logits_inputs(t, 32, s, seed=6)
    ks64 = torch.arange(t, device="cuda", dtype=torch.int64) * (s - width) // (t - 1)
    ks = ks64.to(torch.int32)
    ke = (ks64 + width - torch.arange(t, device="cuda") % 7).to(torch.int32)
    plan = IndexerPlan.from_tensors(ks, ke, 256 << 20)
    got = index_topk(q, k, k_scale, w, ks, ke, topk=topk_k, plan=plan)
    assert len(plan.chunks) > 1
    rows = torch.tensor([0, 1, 2, 32767, 32768, 65533, 65534, 65535, 65536] +
                        torch.randint(0, t, (23,), generator=_gen(8), device="cuda").tolist(), device="cuda")
    ref = mqa_logits_ref(q[rows], k, k_scale, w[rows], ks[rows], ke[rows], dtype=torch.float64)
    for i, r in enumerate(rows.tolist()):
        lo, n = int(ks[r]), int(ke[r] - ks[r])
        sel = got[r].long()
        assert sel.unique().numel() == topk_k and int(sel.min()) >= 0 and int(sel.max()) < n, f"row {r}"
        vals = ref[i, lo:lo + n]
        chosen = torch.zeros(n, dtype=torch.bool, device="cuda")
        chosen[sel] = True
        tol = 2e-3 * float(vals.abs().max())
        assert float(vals[chosen].min()) >= float(vals[~chosen].max()) - tol, f"row {r}: a larger logit left out"


def test_topk_many_rows() -> None:
    t, n, k = T_LONG, 4096, 64
    g = _gen(10)
    x = torch.randn(t, n, generator=g, device="cuda")
    ks = torch.randint(0, 64, (t,), generator=g, device="cuda", dtype=torch.int32)
    ke = (ks + torch.randint(0, n - 64, (t,), generator=g, device="cuda", dtype=torch.int32)).int()
    assert torch.equal(topk(x, ks, ke, k), topk_ref(x, ks, ke, k))


def test_topk_million_keys() -> None:
    t, n, k = 12, (1 << 20) + 5, 2048
    g = _gen(11)
    x = torch.randn(t, n, generator=g, device="cuda")
    ks = torch.randint(0, 100, (t,), generator=g, device="cuda", dtype=torch.int32)
    ke = torch.full((t,), n, device="cuda", dtype=torch.int32) - torch.randint(0, 100, (t,), generator=g,
                                                                                device="cuda", dtype=torch.int32)
    assert torch.equal(topk(x, ks, ke, k), topk_ref(x, ks, ke, k))


@pytest.mark.parametrize("page_bytes", [256, 132])
def test_page_gather_many_entries(page_bytes: int) -> None:
    from cpkv.kernels.page_gather.ref import page_gather_ref
    from cpkv.kernels.page_gather.triton import gather_launcher, page_gather_triton

    n, g = (1 << 17) + 1, _gen(page_bytes)
    sizes = [S_LONG, 1000]
    sources = [torch.randint(0, 256, (m, page_bytes), generator=g, device="cuda", dtype=torch.uint8) for m in sizes]
    src = torch.randint(-1, 2, (n,), generator=g, device="cuda", dtype=torch.int32)
    page = torch.where(src == 0, torch.randint(0, sizes[0], (n,), generator=g, device="cuda"),
                       torch.randint(0, sizes[1], (n,), generator=g, device="cuda"))
    page[-1], src[-1] = sizes[0] - 1, 0  # the pool's last page
    dest = torch.randperm(n, generator=g, device="cuda").to(torch.int32)
    bases = torch.tensor([s.data_ptr() for s in sources], dtype=torch.int64, device="cuda")
    want = torch.empty(n, page_bytes, dtype=torch.uint8, device="cuda")
    page_gather_ref(want, sources, dest, src, page)
    got = torch.full_like(want, 7)
    page_gather_triton(got, bases, dest, src, page)
    assert torch.equal(got, want)
    got2 = torch.full_like(want, 9)
    gather_launcher(got2, bases, dest, src, page)()  # the prepared launch compose makes
    assert torch.equal(got2, want)


def test_token_kv_million_rows() -> None:
    s = (1 << 20) + 3
    x = torch.randn(s, 576, generator=_gen(12), device="cuda") * 3
    x[7, :128] = 0  # a zero group: scale 0
    rows = quant_token_kv(x)
    assert torch.equal(rows, quant_token_kv_ref(x))
    assert torch.equal(dequant_token_kv(rows).view(torch.int16), dequant_token_kv_ref(rows).view(torch.int16))
    assert rows.shape == (s, GLM5_TOKEN.row_bytes)


def test_index_quant_long() -> None:
    # pure torch (no kernel): the same bytes on the GPU as on the CPU at S >= 2^17 keys and T = 65,537 queries
    g = _gen(13)
    k = torch.randn(S_LONG, 128, generator=g, device="cuda", dtype=torch.bfloat16)
    assert torch.equal(quantize_index_keys(k).cpu(), quantize_index_keys(k.cpu()))
    q = torch.randn(T_LONG, 32, 128, generator=g, device="cuda")
    w = torch.randn(T_LONG, 32, generator=g, device="cuda")
    q8, wf = quantize_queries(q, w)
    q8c, wfc = quantize_queries(q.cpu(), w.cpu())
    assert torch.equal(q8.view(torch.uint8).cpu(), q8c.view(torch.uint8)) and torch.equal(wf.cpu(), wfc)

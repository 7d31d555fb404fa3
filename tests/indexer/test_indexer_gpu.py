"""GPU tests of the indexer's Triton kernels against the references (skip without CUDA or Triton).

Tolerances: logits vs the float64 reference within 2e-3 of each row's largest |logit| (fp8 and bf16
products are exact in float32; the error is the tensor cores' float32 accumulation over D and the
head sum); -inf positions and every top-k index exactly equal."""
from __future__ import annotations

import pytest
import torch

from cpkv.indexer import (
    IndexerPlan,
    dequantize_index_rows,
    index_topk,
    mqa_logits,
    mqa_logits_ref,
    quantize_index_keys,
    quantize_queries,
    topk,
    topk_ref,
)

# every logits / top-k kernel variant the bench can select (None = the default config); small spans so that
# one row crosses several programs
LOGITS_VARIANTS = {"default": None,
                   "gluon_span3_st2": dict(gluon_span=3, gluon_stages=2),
                   "gluon_span5_st3": dict(gluon_span=5, gluon_stages=3),
                   "gluon_span3_unsplit": dict(gluon_span=3, gluon_split=1),
                   "lanes_w4_s64": dict(variant="lanes", tma=False, block_s=64, num_warps=4, maxnreg=None),
                   "lanes_w4_s64_r128": dict(variant="lanes", tma=False, block_s=64, num_warps=4, maxnreg=128),
                   "lanes_w8_s128": dict(variant="lanes", tma=False),
                   "tma_w8_s128": dict(variant="lanes", tma=True),
                   "tma_w4_s64": dict(variant="lanes", tma=True, block_s=64, num_warps=4, maxnreg=None)}
TOPK_VARIANTS = {"default": None, "stream": dict(splits=1), "stream_d2": dict(depth=2, splits=1),
                 "stream_w8": dict(num_warps=8, programs_per_sm=2, block=2048, splits=1), "split4": dict(splits=4),
                 "split64": dict(splits=64), "split8_pdl": dict(splits=8, pdl=True)}


def _logits_cfg(name):
    from cpkv.kernels.mqa_logits.triton import LogitsConfig

    kw = LOGITS_VARIANTS[name]
    return None if kw is None else LogitsConfig(**kw)


def _topk_cfg(name):
    from cpkv.kernels.topk.triton import TopkConfig

    kw = TOPK_VARIANTS[name]
    return None if kw is None else TopkConfig(**kw)


pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)
FP8 = torch.float8_e4m3fn


def _inputs(T, H, D, S, seed=0, dtype=FP8, causal=False):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, w = quantize_queries(torch.randn(T, H, D, device="cuda", generator=g),
                            torch.randn(T, H, device="cuda", generator=g))
    k, k_scale = dequantize_index_rows(quantize_index_keys(torch.randn(S, D, device="cuda", generator=g)))
    if dtype == torch.bfloat16:
        q, k = q.to(torch.bfloat16), k.to(torch.bfloat16)
    if causal:
        ks = torch.zeros(T, dtype=torch.int32, device="cuda")
        ke = torch.arange(S - T + 1, S + 1, dtype=torch.int32, device="cuda")
    else:
        ks = torch.randint(0, S // 2, (T,), device="cuda", generator=g, dtype=torch.int32)
        ke = (ks + torch.randint(0, S, (T,), device="cuda", generator=g, dtype=torch.int32)).clamp(max=S).int()
    ks[1], ke[1] = 9, 9  # no valid key
    return q, k, k_scale, w, ks, ke


def _assert_logits_close(out, ref):
    assert torch.equal(torch.isinf(out), torch.isinf(ref)), "-inf positions differ"
    fin = torch.isfinite(ref)
    scale = ref.masked_fill(~fin, 0).abs().amax(1, keepdim=True).clamp(min=1e-30)
    err = ((out.double() - ref).abs() / scale).masked_fill(~fin, 0)
    assert float(err.max()) < 2e-3, f"max error {float(err.max()):.3g} at {divmod(int(err.argmax()), err.shape[1])}"


@pytest.mark.parametrize("variant", ["default", "gluon_span3_st2", "gluon_span5_st3", "gluon_span3_unsplit",
                                     "lanes_w4_s64", "lanes_w4_s64_r128", "tma_w8_s128", "tma_w4_s64"])
@pytest.mark.parametrize("H", [8, 16, 32, 64])
@pytest.mark.parametrize("D", [64, 128])
def test_logits_kernel_fp8(H, D, variant):
    q, k, k_scale, w, ks, ke = _inputs(77, H, D, 700, seed=H + D)
    out = mqa_logits(q, k, k_scale, w, ks, ke, config=_logits_cfg(variant))
    _assert_logits_close(out, mqa_logits_ref(q, k, k_scale, w, ks, ke, dtype=torch.float64))
    assert bool((out[1] == float("-inf")).all())


@pytest.mark.parametrize("variant", ["default", "lanes_w4_s64", "tma_w8_s128"])
@pytest.mark.parametrize("H,D", [(32, 128), (8, 64)])
def test_logits_kernel_bf16_and_mixed(H, D, variant):
    cfg = _logits_cfg(variant)
    q, k, k_scale, w, ks, ke = _inputs(50, H, D, 333, seed=7, dtype=torch.bfloat16)
    ref = mqa_logits_ref(q, k, k_scale, w, ks, ke, dtype=torch.float64)
    _assert_logits_close(mqa_logits(q, k, k_scale, w, ks, ke, config=cfg), ref)
    q8 = q.to(FP8)  # fp8 queries against bf16 keys
    _assert_logits_close(mqa_logits(q8, k, k_scale, w, ks, ke, config=cfg),
                         mqa_logits_ref(q8, k, k_scale, w, ks, ke, dtype=torch.float64))


@pytest.mark.parametrize("variant", list(LOGITS_VARIANTS))
def test_logits_kernel_causal_and_unclean(variant):
    cfg = _logits_cfg(variant)
    q, k, k_scale, w, ks, ke = _inputs(300, 32, 128, 2000, seed=3, causal=True)
    clean = mqa_logits(q, k, k_scale, w, ks, ke, config=cfg)
    _assert_logits_close(clean, mqa_logits_ref(q, k, k_scale, w, ks, ke, dtype=torch.float64))
    raw = mqa_logits(q, k, k_scale, w, ks, ke, clean=False, config=cfg)
    fin = torch.isfinite(clean)
    assert torch.equal(raw[fin], clean[fin])


def _ragged_rows(T, N, seed, k):
    g = torch.Generator(device="cuda").manual_seed(seed)
    ks = torch.randint(0, 50, (T,), device="cuda", generator=g, dtype=torch.int32)
    n = torch.randint(0, N - 50, (T,), device="cuda", generator=g, dtype=torch.int32)
    n[:4] = torch.tensor([0, 1, k, k + 1], dtype=torch.int32)
    return ks, (ks + n).int()


@pytest.mark.parametrize("variant", list(TOPK_VARIANTS))
@pytest.mark.parametrize("k", [16, 2048])
@pytest.mark.parametrize("N", [3000, 70000])
def test_topk_kernel_random(k, N, variant):
    x = torch.randn(64, N, device="cuda")
    ks, ke = _ragged_rows(64, N, seed=N + k, k=k)
    assert torch.equal(topk(x, ks, ke, k, config=_topk_cfg(variant)), topk_ref(x, ks, ke, k))


@pytest.mark.parametrize("variant", list(TOPK_VARIANTS))
def test_topk_kernel_many_rows_long(variant):
    # 600 rows of 131072 keys: enough rows for a rare sample miss (retry path) to occur
    x = torch.randn(600, 131072, device="cuda")
    ks = torch.randint(0, 16, (600,), device="cuda", dtype=torch.int32)
    ke = torch.full((600,), 131072, device="cuda", dtype=torch.int32) - ks
    assert torch.equal(topk(x, ks, ke, 2048, config=_topk_cfg(variant)), topk_ref(x, ks, ke, 2048))


@pytest.mark.parametrize("variant", list(TOPK_VARIANTS))
@pytest.mark.parametrize("levels", [2, 50, 1000])
def test_topk_kernel_ties(levels, variant):
    g = torch.Generator(device="cuda").manual_seed(levels)
    x = torch.randint(0, levels, (48, 20000), device="cuda", generator=g).float() - levels / 2
    x[0, ::3] = -0.0
    x[1, ::5] = float("-inf")
    ks, ke = _ragged_rows(48, 20000, seed=levels, k=256)
    assert torch.equal(topk(x, ks, ke, 256, config=_topk_cfg(variant)), topk_ref(x, ks, ke, 256))


def test_topk_kernel_unaligned_view():
    base = torch.randn(40, 9001, device="cuda")
    x = base[:, 3:8990]  # rows not 16-byte aligned: the wrapper copies
    ks, ke = _ragged_rows(40, 8987, seed=1, k=100)
    assert torch.equal(topk(x, ks, ke, 100), topk_ref(x, ks, ke, 100))


@pytest.mark.parametrize("variant", list(TOPK_VARIANTS))
def test_topk_kernel_skewed_rows(variant):
    # increasing values: the sample sees the whole range, the top keys sit at the row's end
    x = torch.arange(100000, device="cuda", dtype=torch.float32).repeat(8, 1)
    x[4:] = x[4:].flip(1)
    ks = torch.zeros(8, dtype=torch.int32, device="cuda")
    ke = torch.full((8,), 100000, dtype=torch.int32, device="cuda")
    assert torch.equal(topk(x, ks, ke, 2048, config=_topk_cfg(variant)), topk_ref(x, ks, ke, 2048))


@pytest.mark.parametrize("budget", [None, 1 << 20, 300_000])
def test_index_topk_chunked_equals_full(budget):
    q, k, k_scale, w, ks, ke = _inputs(400, 32, 128, 9000, seed=11, causal=True)
    want = topk(mqa_logits(q, k, k_scale, w, ks, ke), ks, ke, 2048)
    assert torch.equal(index_topk(q, k, k_scale, w, ks, ke, topk=2048, chunk_max_bytes=budget), want)


@pytest.mark.parametrize("lv,tv", [("lanes_w8_s128", "default"), ("tma_w4_s64", "stream_d2"), ("tma_w8_s128", "stream_w8"),
                                   ("gluon_span3_st2", "stream_d2")])
def test_index_topk_variants_agree(lv, tv):
    q, k, k_scale, w, ks, ke = _inputs(400, 32, 128, 9000, seed=12, causal=True)
    want = topk_ref(mqa_logits(q, k, k_scale, w, ks, ke, config=_logits_cfg(lv)), ks, ke, 2048)
    got = index_topk(q, k, k_scale, w, ks, ke, topk=2048, chunk_max_bytes=1 << 20,
                     logits_config=_logits_cfg(lv), topk_config=_topk_cfg(tv))
    assert torch.equal(got, want)


def test_index_topk_plan_zigzag():
    g = torch.Generator(device="cuda").manual_seed(5)
    requests = [(0, list(range(0, 256)) + list(range(3840, 4096))), (4096, list(range(6000, 6300)))]
    plan = IndexerPlan.build(requests, "cuda", chunk_max_bytes=2 << 20)
    S, T = 4096 + 6300, plan.num_tokens
    q, w = quantize_queries(torch.randn(T, 32, 128, device="cuda", generator=g),
                            torch.randn(T, 32, device="cuda", generator=g))
    k, k_scale = dequantize_index_rows(quantize_index_keys(torch.randn(S, 128, device="cuda", generator=g)))
    want = topk(mqa_logits(q, k, k_scale, w, plan.ks, plan.ke), plan.ks, plan.ke, 2048)
    got = index_topk(q, k, k_scale, w, plan.ks, plan.ke, topk=2048, plan=plan)
    assert len(plan.chunks) > 1 and torch.equal(got, want)


def test_index_topk_absolute_written_by_the_kernel():
    """The top-k kernel adds each row's ks itself (``absolute``): ``topk_to_slots`` of the relative result, byte for
    byte, over chunks with and without logits, with no host sync."""
    from cpkv.indexer import topk_to_slots

    g = torch.Generator(device="cuda").manual_seed(6)
    requests = [(0, list(range(0, 256)) + list(range(3840, 4096))), (4096, list(range(6000, 6300))), (10400, [0, 5])]
    plan = IndexerPlan.build(requests, "cuda", chunk_max_bytes=2 << 20)
    T = plan.num_tokens
    q, w = quantize_queries(torch.randn(T, 32, 128, device="cuda", generator=g),
                            torch.randn(T, 32, device="cuda", generator=g))
    k, k_scale = dequantize_index_rows(quantize_index_keys(torch.randn(10402, 128, device="cuda", generator=g)))
    rel = index_topk(q, k, k_scale, w, plan.ks, plan.ke, topk=2048, plan=plan)
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = index_topk(q, k, k_scale, w, plan.ks, plan.ke, topk=2048, plan=plan, absolute=True)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert len(plan.chunks) > 1 and torch.equal(got, topk_to_slots(rel, plan.ks))


def test_logits_default_takes_gluon_kernel_on_hopper():
    # the bench shapes (fp8, H = 32, D = 128) must reach the Gluon kernel, not its Triton fallback
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm_90")
    from cpkv.indexer.logits import aligned_keys
    from cpkv.kernels.mqa_logits.triton import _gluon_applies

    q, k, _, _, _, _ = _inputs(8, 32, 128, 100)
    assert _gluon_applies(q, aligned_keys(k))
    assert not _gluon_applies(q.to(torch.bfloat16), aligned_keys(k))


def test_logits_configs_that_do_not_exist_are_refused():
    from cpkv.kernels.mqa_logits.config import LogitsConfig

    for bad in (dict(variant="base"), dict(gluon_split=0)):
        with pytest.raises(ValueError, match="variant|split"):
            LogitsConfig(**bad)


@pytest.mark.parametrize("cfg", [dict(), dict(gluon_span=3, gluon_split=1), dict(gluon_span=5, gluon_split=2),
                                 dict(gluon_span=4, gluon_stages=3)])
def test_logits_work_items_equal_the_grid(cfg):
    # a ragged warm batch: the plan's work items launch only non-empty programs, span by span, the last
    # wave cut short; every visible logit must equal the clean grid run's bit for bit (same tiles)
    from cpkv.indexer.logits import aligned_keys, logits_into
    from cpkv.kernels.mqa_logits.triton import LogitsConfig, work_shape

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel is for sm_90")
    config = LogitsConfig(**cfg)
    g = torch.Generator(device="cuda").manual_seed(21)
    requests = [(0, list(range(1500, 1530))), (1530, list(range(4000, 4077))), (5607, list(range(0, 9))),
                (5616, list(range(700, 701)) + list(range(2000, 2040)))]
    plan = IndexerPlan.build(requests, "cuda")
    T, S = plan.num_tokens, 5616 + 2040
    q, w = quantize_queries(torch.randn(T, 32, 128, device="cuda", generator=g),
                            torch.randn(T, 32, device="cuda", generator=g))
    k, k_scale = dequantize_index_rows(quantize_index_keys(torch.randn(S, 128, device="cuda", generator=g)))
    k = aligned_keys(k)
    c = plan.chunks[0]
    want = mqa_logits(q, k, k_scale, w, plan.ks, plan.ke, config=config)[:, c.key_start:c.key_end]
    _assert_logits_close(want, mqa_logits_ref(q, k, k_scale, w, plan.ks, plan.ke, dtype=torch.float64)[:, c.key_start:c.key_end])
    shape = work_shape(q, k, config)
    assert shape is not None and shape.rows == 4  # 128 // 32 tokens per program
    from cpkv.kernels.mqa_logits.triton import planned_work_shape
    assert planned_work_shape(32, 128, q.device, config) == shape  # what a batch plan builds its items for
    items = plan.work_items(c, shape)
    assert items.is_cuda and items.shape[0] > 0
    got = torch.full((T, c.width), 12345.0, device="cuda")
    logits_into(q, k, k_scale, w, plan.ks, plan.ke, got, col_offset=c.key_start, clean=False, config=config,
                work=lambda s: plan.work_items(c, s))
    fin = torch.isfinite(want)
    assert torch.equal(got[fin], want[fin])
    got_idx = index_topk(q, k, k_scale, w, plan.ks, plan.ke, topk=64, plan=plan, logits_config=config)
    assert torch.equal(got_idx, topk(want, plan.ks - c.key_start, plan.ke - c.key_start, 64))
    from cpkv.kernels.mqa_logits.gluon import mqa_logits_gluon

    with pytest.raises(ValueError, match="clean=False"):
        mqa_logits_gluon(q, k, k_scale, w, plan.ks, plan.ke, got, col_offset=c.key_start, clean=True, items=items)

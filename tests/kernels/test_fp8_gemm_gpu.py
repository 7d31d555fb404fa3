"""GPU tests of the block-scaled fp8 GEMMs (skip without CUDA or Triton): the Triton activation quantisation
against its reference, ``torch._scaled_mm``'s block-scaled linear and the grouped fp8 expert GEMM against
float32 references of the same quantised operands, and GLM-5's first 4 layers with fp8 weights at cp 2 under
the sync check.

Tolerances: outputs are bfloat16 (8 significant bits) of float32 accumulations, so a GEMM is held to
1e-2 of its largest |reference| value; a whole SwiGLU (two GEMMs, the activation quantised twice on the
fp8 path, once more than the reference) to 4e-2.
"""
from __future__ import annotations

import pytest
import torch
from sync_free import twice_sync_free

from cpkv.kernels.fp8_gemm.ref import act_dequant_ref, act_quant_ref, dequant_blocks, fp8_linear_quant_ref, grouped_fp8_ref
from cpkv.model import linear as linear_mod
from cpkv.model.experts import ExpertWeights, grouped_swiglu, grouped_swiglu_loop
from cpkv.model.linear import Linear, fp8_linear, quant_act, scaled_mm_ok, swiglu
from cpkv.model.weights import quant_fp8_blocks

pytestmark = [pytest.mark.cuda, pytest.mark.triton]  # skipped without them (tests/conftest.py)

GEMM_TOL, SWIGLU_TOL = 1e-2, 4e-2


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).abs().max()) / max(float(want.abs().max()), 1e-30)


def _weight(n: int, k: int, seed: int, e: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (n, k) if e is None else (e, n, k)
    w = torch.randn(shape, generator=gen, device="cuda") / k ** 0.5
    if e is None:
        return quant_fp8_blocks(w)
    pairs = [quant_fp8_blocks(w[i]) for i in range(e)]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])


def _x(m: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(m, k, generator=gen, device="cuda").to(torch.bfloat16)


def test_quantisation_bounded_by_a_device_row_count():
    """``rows`` (an int32 device value: the expert exchange's real row count): the rows before it quantised as
    without a bound, the rows past it untouched; the SwiGLU quantisation alike; no host sync."""
    from cpkv.kernels.fp8_gemm import triton as kern

    m, k, live = 300, 2048, 133
    x = _x(m, k, 5)
    rows = torch.tensor([live], dtype=torch.int32, device="cuda")
    q = torch.full((m, k), 7.0, device="cuda").to(torch.float8_e4m3fn)
    s = torch.full((m, k // 128), -1.0, device="cuda")
    kern.act_quant(x, q, s, rows)
    qa, sa = act_quant_ref(x[:live])
    assert torch.equal(q[:live].view(torch.uint8), qa.view(torch.uint8)) and torch.equal(s[:live], sa)
    assert bool((q[live:].float() == 7.0).all()) and bool((s[live:] == -1.0).all())
    gu = _x(m, 2 * k, 6)
    q2 = torch.full((m, k), 7.0, device="cuda").to(torch.float8_e4m3fn)
    s2 = torch.full((m, k // 128), -1.0, device="cuda")
    want_q, want_s = q2.clone(), s2.clone()
    kern.swiglu_quant(gu, None, q2, s2, rows)
    kern.swiglu_quant(gu[:live], None, want_q[:live], want_s[:live])
    assert torch.equal(q2.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s2, want_s)


@pytest.mark.parametrize("m,k", [(1, 128), (77, 6144), (4096, 2048), (3, 300), (0, 512)])
def test_triton_activation_quant_equals_reference(m, k):
    """Same IEEE quotient, same round-to-nearest-even to e4m3: bytes and scales equal; scales outer-dim-major."""
    x = _x(m, k, 1)
    if m:
        x[0, :128] = 0  # a zero group
    qa = quant_act(x)
    q, s = act_quant_ref(x)
    assert qa.s.shape == (m, -(-k // 128)) and qa.s.stride() == (1, max(4, -(-m // 4) * 4))
    assert torch.equal(qa.s, s)
    assert torch.equal(qa.q.view(torch.uint8), q.view(torch.uint8))


# GLM-5 projection shapes (N, K): kv_a, q_a, q_b, o, dense gate_up, dense down, indexer wk
GLM5 = [(576, 6144), (2048, 6144), (16384, 2048), (6144, 16384), (24576, 6144), (6144, 12288), (128, 6144)]


@pytest.mark.parametrize("n,k", GLM5)
@pytest.mark.parametrize("m", [1, 200, 4096])
def test_block_scaled_linear_equals_float32_reference(m, n, k):
    w, ws = _weight(n, k, 2)
    x = _x(m, k, 3)
    assert scaled_mm_ok(x, w)
    got = fp8_linear(x, w, ws)
    assert not linear_mod._SCALED_MM_FAILED, f"torch._scaled_mm refused weight shapes {linear_mod._SCALED_MM_FAILED}"
    qa = quant_act(x)
    want = fp8_linear_quant_ref(qa.q, qa.s, w, ws)
    assert got.dtype == torch.bfloat16 and got.shape == (m, n)
    assert _rel(got, want) <= GEMM_TOL
    assert _rel(got, x.float() @ dequant_blocks(w, ws).t()) <= 0.1  # and near the unquantised activation


@pytest.mark.parametrize("m,n,k", [(33, 200, 300), (16, 64, 256), (0, 512, 512)])
def test_shapes_off_scaled_mm_take_the_reference(m, n, k):
    w, ws = _weight(n, k, 4)
    x = _x(m, k, 5)
    assert not scaled_mm_ok(x, w) or m == 0
    got = fp8_linear(x, w, ws)
    assert got.shape == (m, n)
    if m:
        assert _rel(got, x.float() @ dequant_blocks(w, ws).t()) <= GEMM_TOL


def test_fused_swiglu_quant_mlp():
    """Dense MLP at GLM-5 shapes: gate_up GEMM, SiLU x up quantised in one kernel, down GEMM."""
    gu, gus = _weight(2 * 12288, 6144, 6)
    dn, dns = _weight(6144, 12288, 7)
    x = _x(300, 6144, 8)
    got = swiglu(x, Linear(gu, gus), Linear(dn, dns))
    g, u = (x.float() @ dequant_blocks(gu, gus).t()).chunk(2, dim=-1)
    want = (torch.nn.functional.silu(g) * u) @ dequant_blocks(dn, dns).t()
    assert _rel(got, want) <= SWIGLU_TOL


LOADS = {"ragged": [5, 0, 130, 1, 0, 64, 3, 0], "one": [0, 0, 0, 257, 0, 0, 0, 0], "none": [0] * 8,
         "even": [128] * 8}


@pytest.mark.parametrize("load", list(LOADS))
@pytest.mark.parametrize("n,k", [(4096, 6144), (6144, 2048), (200, 300)])
def test_grouped_gemm_equals_reference(load, n, k):
    from cpkv.kernels.fp8_gemm import triton as kern

    counts = LOADS[load]
    e, rows = len(counts), sum(counts) + 7  # 7 padding rows past offs[-1]
    w, ws = _weight(n, k, 9, e)
    q, s = act_quant_ref(_x(rows, k, 10))
    offs = torch.tensor(counts, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    c = torch.full((rows, n), 3.0, dtype=torch.bfloat16, device="cuda")
    kern.grouped_gemm(q, s, offs, w, ws, c)
    want = grouped_fp8_ref(q, s, offs, w, ws)
    done = sum(counts)
    if done:
        assert _rel(c[:done], want[:done]) <= GEMM_TOL
    assert bool((c[done:] == 3.0).all())  # padding rows are not written


def _variant_configs() -> list[tuple[str, dict]]:
    from cpkv.kernels.fp8_gemm.triton import VARIANTS

    out = []
    for v in VARIANTS:
        if VARIANTS[v].get("GLUON"):  # 128 x 128 tiles, 4 warps per warpgroup; the shallowest ring and an odd one
            deep = 3 if VARIANTS[v].get("WIDE") else 5  # (WIDE: 48 KB stages)
            out += [(v, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": st}) for st in (2, deep)]
            continue
        out += [(v, {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3}),
                (v, {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 4})]
    return out


# the variants added for issue 22's second round that measurement kept (the warp-specialised Gluon kernel with
# the TMA-store epilogue, the scale-prefetching Triton variant with the expert map in registers)
NEW_VARIANTS = ("v16", "gluon_ws_pair_g8_tma_ah", "gluon_ws_g8_tma_ah", "gluon_ws_n256_g8_tma_ah")


def _scales(s: torch.Tensor, kmajor: bool = False) -> torch.Tensor:
    """Activation scales s [R, G] row-major (as the model allocates them), or K-major (strides (1, R)) when
    ``kmajor``: the same values (the kernels take any strides)."""
    if not kmajor:
        return s.contiguous()
    out = torch.empty(s.shape[1], s.shape[0], dtype=s.dtype, device=s.device).t()
    return out.copy_(s)


@pytest.mark.parametrize("variant,config", _variant_configs(), ids=lambda x: x if isinstance(x, str) else
                         "{BLOCK_M}x{BLOCK_N}w{num_warps}s{num_stages}".format(**x))
@pytest.mark.parametrize("load", ["ragged", "one", "none"])
@pytest.mark.parametrize("n,k", [(4096, 6144), (200, 300)])
def test_grouped_gemm_variants_equal_reference(variant, config, load, n, k):
    """Every variant of the grouped kernel (benchmarks/grouped_fp8_sweep.py times them) against the float32
    reference; padding rows untouched; a zero activation group (scale 0) included."""
    from cpkv.kernels.fp8_gemm import triton as kern

    counts = LOADS[load]
    e, rows = len(counts), sum(counts) + 7
    w, ws = _weight(n, k, 16, e)
    x = _x(rows, k, 17)
    x[2, :128] = 0
    q, s = act_quant_ref(x)
    offs = torch.tensor(counts, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    c = torch.full((rows, n), 3.0, dtype=torch.bfloat16, device="cuda")
    kern.grouped_gemm(q, _scales(s), offs, w, ws, c, kern.tile_ends(offs, config["BLOCK_M"]),
                      config=config, variant=variant)
    want = grouped_fp8_ref(q, s, offs, w, ws)
    done = sum(counts)
    if done:
        assert _rel(c[:done], want[:done]) <= GEMM_TOL
    assert bool((c[done:] == 3.0).all())


@pytest.mark.parametrize("with_rw", [False, True])
def test_swiglu_quant_near_reference(with_rw):
    """The fused SiLU x up quantisation against act_quant_ref of torch's SwiGLU in float32: the kernel's exp
    is the GPU's approximate one (its quotients are IEEE), so scales agree to 1e-5 and fp8 values to one step."""
    from cpkv.kernels.fp8_gemm import triton as kern
    from cpkv.model.linear import empty_quant

    m, i = 300, 2048
    gu = _x(m, 2 * i, 18)
    gu[1, :128] = 0  # a zero group
    rw = torch.rand(m, device="cuda") if with_rw else None
    q, s = empty_quant(m, i, torch.device("cuda"))
    kern.swiglu_quant(gu, rw, q, s)
    g, u = gu.float().chunk(2, dim=-1)
    a = torch.nn.functional.silu(g) * u * (rw[:, None] if with_rw else 1.0)
    q_ref, s_ref = act_quant_ref(a)
    assert torch.allclose(s, s_ref, rtol=1e-5, atol=0)
    got, want = q.float(), q_ref.float()
    assert bool(((got - want).abs() <= want.abs() * 2.0 ** -3 + 2.0 ** -9).all())
    assert float((got != want).float().mean()) < 1e-2


@pytest.mark.parametrize("variant", [None, *NEW_VARIANTS])
def test_grouped_gemm_zero_rows(variant):
    from cpkv.kernels.fp8_gemm import triton as kern

    w, ws = _weight(256, 512, 11, 4)
    q, s = act_quant_ref(_x(0, 512, 12))
    c = torch.empty(0, 256, dtype=torch.bfloat16, device="cuda")
    kern.grouped_gemm(q, s, torch.zeros(4, dtype=torch.int32, device="cuda"), w, ws, c, variant=variant)
    torch.cuda.synchronize()


def test_gluon_kernel_takes_glm5_expert_shapes():
    """On Hopper the GLUON variants run the warp-specialised kernel at GLM-5's expert shapes (so the variant
    tests and the sweep time it, not the Triton fallback); elsewhere they fall back."""
    from cpkv.kernels import platform
    from cpkv.kernels.fp8_gemm import gluon_ws

    for n, k in [(4096, 6144), (6144, 2048)]:
        w, _ = _weight(n, k, 19, 2)
        q, _ = act_quant_ref(_x(300, k, 20))
        c = torch.empty(300, n, dtype=torch.bfloat16, device="cuda")
        why = gluon_ws.applies(q, w, c)
        if platform.capability(q)[0] == 9 and platform.gluon_importable():
            assert why is None, why
        else:
            assert why and "Hopper" in why


# a skewed load of 20 experts (empty ones first, inside and last; 1 to 1,100 rows, 4,397 in all): 43 row tiles x
# 32 or 48 column tiles, so every persistent program walks 10-16 tiles and the TMA ring wraps many times
BIG_LOAD = [0, 0, 700, 129, 1, 1100, 0, 300, 77, 128, 255, 3, 0, 640, 64, 65, 900, 2, 33, 0]


@pytest.mark.parametrize("kmajor", [False, True])
@pytest.mark.parametrize("variant", NEW_VARIANTS)
@pytest.mark.parametrize("n,k", [(4096, 6144), (6144, 2048)])
def test_new_variants_on_a_big_ragged_load(variant, n, k, kmajor):
    """The new variants at GLM-5's expert shapes on BIG_LOAD with either activation-scale layout (the kernels
    take any strides): within 1e-2 of the float32 reference, 5 padding rows untouched, a zero group included."""
    from cpkv.kernels.fp8_gemm import triton as kern

    e, rows = len(BIG_LOAD), sum(BIG_LOAD) + 5
    w, ws = _weight(n, k, 21, e)
    x = _x(rows, k, 22)
    x[700, 128:256] = 0
    q, s = act_quant_ref(x)
    offs = torch.tensor(BIG_LOAD, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    c = torch.full((rows, n), 3.0, dtype=torch.bfloat16, device="cuda")
    cfg = ({"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3 if kern.VARIANTS[variant].get("WIDE") else 4}
           if kern.VARIANTS[variant].get("GLUON") else {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 3})
    kern.grouped_gemm(q, _scales(s, kmajor), offs, w, ws, c, kern.tile_ends(offs, 128), config=cfg,
                      variant=variant)
    want = grouped_fp8_ref(q, s, offs, w, ws)
    done = sum(BIG_LOAD)
    assert _rel(c[:done], want[:done]) <= GEMM_TOL
    assert bool((c[done:] == 3.0).all())


# rows per expert around the 64-row halves the TMA epilogue stores whole: ends on a half, one row short of and
# past one, a single row, empty experts; 13 padding rows past them
HALVES = [64, 0, 191, 128, 1, 63, 65, 0, 320, 127]


@pytest.mark.parametrize("variant,stages,n", [
    ("gluon_ws_pair_g8_tma_ah", 4, 384), ("gluon_ws_pair_g8_tma_ah", 6, 512), ("gluon_ws_g8_tma_ah", 4, 384),
    ("gluon_ws_g8_tma_ah", 6, 512), ("gluon_ws_pair_g8_tma_ah", 4, 512), ("gluon_ws_g8_tma_ah", 5, 384),
    ("gluon_ws_n256_g8_tma_ah", 3, 512), ("gluon_ws_n256_g8_tma_ah", 2, 768),
    ("gluon_ws_n256_g8_tma_ah", 3, 384)])  # (N 384: 128-column tiles)
def test_tma_epilogue_writes_only_the_experts_rows(variant, stages, n):
    """The TMA-store epilogue (whole 64-row halves by TMA, the expert's partial half from registers; WIDE: two
    128-column halves each) gives the bytes of the register epilogue (the kernel launched with the variant's
    PAIR and GROUP_M, without EPI_TMA, AHEAD and WIDE: the same accumulation) into a strided view of a wider,
    taller buffer: nothing outside the view, no padding row written; and into a c whose rows are not 16-byte
    aligned (the register epilogue then runs, WIDE on 128-column tiles): the same bytes."""
    from cpkv.kernels.fp8_gemm import gluon_ws
    from cpkv.kernels.fp8_gemm import triton as kern

    k, pad = 512, 13
    e, rows = len(HALVES), sum(HALVES) + pad
    w, ws = _weight(n, k, 23, e)
    x = _x(rows, k, 24)
    x[64, :128] = 0  # a zero group
    q, s = act_quant_ref(x)
    offs = torch.tensor(HALVES, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": stages}
    flags = kern.VARIANTS[variant]
    want = torch.full((rows, n), 3.0, dtype=torch.bfloat16, device="cuda")
    gluon_ws.launch(q, s, offs, w, ws, want, kern.tile_ends(offs, 128), stages=stages, pair=bool(flags.get("PAIR")),
                    group_m=flags["GROUP_M"])
    done = sum(HALVES)
    assert _rel(want[:done], grouped_fp8_ref(q, s, offs, w, ws)[:done]) <= GEMM_TOL
    big = torch.full((rows + 5, n + 192), 3.0, dtype=torch.bfloat16, device="cuda")
    c = big[2:2 + rows, 64:64 + n]  # 16-byte aligned base and row stride: the TMA epilogue
    assert gluon_ws.tma_epilogue_applies(c)
    kern.grouped_gemm(q, s, offs, w, ws, c, config=cfg, variant=variant)
    assert torch.equal(c, want)
    outside = torch.ones_like(big, dtype=torch.bool)
    outside[2:2 + rows, 64:64 + n] = False
    assert bool((big[outside] == 3.0).all())
    odd = torch.full((rows, n + 1), 3.0, dtype=torch.bfloat16, device="cuda")[:, :n]  # rows of 2 (N + 1) bytes
    assert not gluon_ws.tma_epilogue_applies(odd)
    kern.grouped_gemm(q, s, offs, w, ws, odd, config=cfg, variant=variant)
    assert torch.equal(odd, want)


@pytest.mark.parametrize("load", ["ragged", "none", "one"])
def test_grouped_swiglu_fp8_equals_float32_loop_without_host_sync(load):
    """GLM-5 expert shapes (D 6144, I 2048), 8 local experts: the fp8 grouped SwiGLU against the float32 loop
    over the dequantised experts; the second call runs under torch's sync debug mode (the first autotunes)."""
    counts = LOADS[load]
    e, d, i = len(counts), 6144, 2048
    gu, gus = _weight(2 * i, d, 13, e)
    dn, dns = _weight(d, i, 14, e)
    ew = ExpertWeights(gu, dn, gus, dns)
    rows = sum(counts) + 5
    xs = _x(rows, d, 15)
    rw = torch.rand(rows, device="cuda")
    offs = torch.tensor(counts, dtype=torch.int32, device="cuda").cumsum(0, dtype=torch.int32)
    got = twice_sync_free(lambda: grouped_swiglu(xs, offs, rw, ew))
    dense = ExpertWeights(dequant_blocks(gu, gus), dequant_blocks(dn, dns))
    # the input as the kernel reads it (1 x 128 fp8 groups): what is left is the SwiGLU's fp8 rounding and bf16
    want = grouped_swiglu_loop(act_dequant_ref(*act_quant_ref(xs)), offs, rw, dense)
    done = sum(counts)
    if done:
        assert _rel(got[:done], want[:done]) <= SWIGLU_TOL


def test_glm5_layers_with_fp8_weights_run_without_a_host_sync():
    """GLM-5's first 4 layers (dense x 3 then MoE) at cp 2 on one GPU, weights quantised to fp8 blocks at load:
    every linear layer on torch._scaled_mm, the routed experts on the grouped Triton kernel, no device->host
    synchronisation in a batch; the logits stay close to the same run with bf16 weights (cosine >= 0.98)."""
    import dataclasses

    from cpkv.engine.config import EngineConfig
    from cpkv.engine.engine import run_jobs
    from cpkv.engine.instruments import MeasureConfig
    from cpkv.scheduler.trace import TraceRequest

    trace = [TraceRequest("a", 0.0, 3000), TraceRequest("b", 0.0, 700)]
    fp8 = EngineConfig(model="glm5", num_layers=4, cp=2, device="cuda", page_size=64, pages_per_rank=120,
                       chunk_size=4096, max_requests=1, warmup=True, weights="fp8")
    res, ref = run_jobs([(fp8, trace, MeasureConfig(sync_check=True)),
                         (dataclasses.replace(fp8, weights="bf16"), trace)],
                        timeout_s=550)
    assert res.stats["weights_dtype"] == "fp8" and ref.stats["weights_dtype"] == "bf16"
    for a, b in zip(res.requests, ref.requests):
        assert bool(torch.isfinite(a.logits).all())
        # fp8 weights and activations round each GEMM's operands by up to 2^-4: the logits move a few percent
        cos = float(torch.nn.functional.cosine_similarity(a.logits.double(), b.logits.double(), dim=0))
        top_a, top_b = set(a.logits.topk(10).indices.tolist()), set(b.logits.topk(10).indices.tolist())
        assert cos >= 0.98 and len(top_a & top_b) >= 3, (a.id, cos, top_a, top_b)


def test_fp8_checkpoint_runs_fp8_on_cuda_and_verifies(tmp_path):
    """A small fp8 block checkpoint (config.json's quantization_config, float8 weights + weight_scale_inv):
    ``--weights auto`` keeps it fp8 on CUDA (some projections on torch._scaled_mm, the others, K not a multiple
    of 512, on the reference path, the experts on the grouped kernel) and the cp 2 run equals the single-rank
    reference with the same weights within the engine's CUDA tolerance."""
    import dataclasses

    from cpkv.config import preset
    from cpkv.engine.config import EngineConfig
    from cpkv.engine.engine import run_engine, verify_run
    from cpkv.model.weights import random_weights, save_checkpoint
    from cpkv.scheduler.trace import TraceRequest

    cfg = dataclasses.replace(preset("tiny"), hidden_size=512, q_lora_rank=512, kv_lora_rank=512,
                              intermediate_size=512, moe_intermediate_size=128, index_n_heads=8)
    save_checkpoint(tmp_path, cfg, random_weights(cfg, seed=5), fp8=True)
    ecfg = EngineConfig(model=str(tmp_path), cp=2, record=True, device="cuda", page_size=64, pages_per_rank=64, chunk_size=512,
                        warmup=True)
    assert ecfg.weights_dtype == "fp8"
    trace = [TraceRequest("a", 0.0, 700), TraceRequest("b", 0.0, 300)]
    res = run_engine(ecfg, trace, timeout_s=300)
    assert res.summary["weights_dtype"] == "fp8"
    report = verify_run(res, trace)
    assert report.ok, report

"""Triton kernel: a layer's token rows from its kv_a output (reference: ``cpkv.kernels.token_rows.ref``).

    token_rows(kv [T, D_L + D_R], weight [D_L], cos / sin float32 [T, D_R / 2], eps,
               fp8 [T, D_L], scale float32 [T, G], rope bfloat16 [T, D_R] (typed views of the uint8 rows),
               out [T, D_L + D_R] kv's dtype | None)

BLOCK_T rows per program, the latent as [BLOCK_T, G, 128] tiles (as ``kernels/token_kv``'s quantisation):
    rstd   = div_rn(1, sqrt_rn(div_rn(sum(x^2), D_L) + eps))             (correctly rounded, as on CPU)
    latent = rne((x * rstd) * weight) in kv's dtype; quantised per 128 group: scale = div_rn(amax, 448),
             fp8 = rne(clamp(div_rn(latent, scale), +-448)) (a zero group: scale 0, zeros)
    rope   = pairs (a, b) = (kv[D_L + 2i], kv[D_L + 2i + 1]): (a cos_i - b sin_i, a sin_i + b cos_i) in float32,
             rounded to kv's dtype, stored as bfloat16
Compiled without floating-point contraction (``enable_fp_fusion=False``): the products and sums round as the
reference's separate torch ops do, so only the order of the float32 sum of squares differs (the latent within
one ulp; rope bytes equal). ``out`` (tests): the latent | rope values the rows were made from.
"""
from __future__ import annotations

import torch

from cpkv.kernels.fp8_gemm.triton import _jit, tl
from cpkv.kernels.grid import cdiv, check_grid

GROUP = 128
LAUNCH = (8, 4)  # (rows per program, warps): kernels/token_kv's quantisation launch


@_jit
def _token_rows(KV, W, COS, SIN, FP8, SCALE, ROPE, OUT, T, eps, stride_kv, stride_c, stride_s, stride_f,
                stride_sc, stride_r, stride_o, D_L: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                BLOCK_T: tl.constexpr, HAS_OUT: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    r64 = rows.to(tl.int64)
    offs_g = tl.arange(0, G)
    lat = (offs_g[:, None] * 128 + tl.arange(0, 128)[None, :])[None, :, :]
    m3 = rmask[:, None, None]
    x = tl.load(KV + r64[:, None, None] * stride_kv + lat, mask=m3, other=0.0).to(tl.float32)
    ss = tl.sum(tl.sum(x * x, axis=2), axis=1)
    rstd = tl.div_rn(1.0, tl.sqrt_rn(tl.div_rn(ss, D_L * 1.0) + eps))
    w = tl.load(W + lat).to(tl.float32)
    y = ((x * rstd[:, None, None]) * w).to(KV.dtype.element_ty)
    yf = y.to(tl.float32)
    amax = tl.max(tl.abs(yf), 2)
    scale = tl.div_rn(amax, 448.0)  # IEEE division, as the reference
    safe = tl.where(scale > 0.0, scale, 1.0)
    v = tl.clamp(tl.div_rn(yf, safe[:, :, None]), -448.0, 448.0)
    tl.store(FP8 + r64[:, None, None] * stride_f + lat, v.to(FP8.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=m3)
    tl.store(SCALE + r64[:, None] * stride_sc + offs_g[None, :], scale, mask=rmask[:, None])
    pair = tl.arange(0, HALF)[None, :]
    m2 = rmask[:, None]
    src = KV + r64[:, None] * stride_kv + D_L + 2 * pair
    a = tl.load(src, mask=m2, other=0.0).to(tl.float32)
    b = tl.load(src + 1, mask=m2, other=0.0).to(tl.float32)
    c = tl.load(COS + r64[:, None] * stride_c + pair, mask=m2, other=0.0)
    s = tl.load(SIN + r64[:, None] * stride_s + pair, mask=m2, other=0.0)
    re = (a * c - b * s).to(KV.dtype.element_ty)
    im = (a * s + b * c).to(KV.dtype.element_ty)
    dst = ROPE + r64[:, None] * stride_r + 2 * pair
    tl.store(dst, re.to(ROPE.dtype.element_ty), mask=m2)
    tl.store(dst + 1, im.to(ROPE.dtype.element_ty), mask=m2)
    if HAS_OUT:
        tl.store(OUT + r64[:, None, None] * stride_o + lat, y, mask=m3)
        o = OUT + r64[:, None] * stride_o + D_L + 2 * pair
        tl.store(o, re, mask=m2)
        tl.store(o + 1, im, mask=m2)


def supported(d_l: int, d_r: int) -> bool:
    """Power-of-two group counts and rope widths (``tl.arange`` needs them); others take the torch path."""
    g = d_l // GROUP
    return d_l == g * GROUP and g >= 1 and g & (g - 1) == 0 and d_r >= 2 and d_r & (d_r - 1) == 0


def token_rows(kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
               fp8: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor, out: torch.Tensor | None = None,
               launch: tuple[int, int] | None = None) -> None:
    """Writes the typed row views fp8, scale, rope (and ``out``) from kv (module docstring); unit column strides."""
    t, d_l = fp8.shape
    if t == 0:
        return
    block_t, warps = launch or LAUNCH
    o = out if out is not None else kv
    _token_rows[check_grid((cdiv(t, block_t),))](
        kv, weight, cos, sin, fp8, scale, rope, o, t, float(eps), kv.stride(0), cos.stride(0), sin.stride(0),
        fp8.stride(0), scale.stride(0), rope.stride(0), o.stride(0), D_L=d_l, G=d_l // GROUP,
        HALF=rope.shape[1] // 2, BLOCK_T=block_t, HAS_OUT=out is not None, num_warps=warps, enable_fp_fusion=False)

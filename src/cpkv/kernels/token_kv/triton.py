"""Triton token-KV row (de)quantisation (reference: ``cpkv.kernels.token_kv.ref``).

Row layout (``cpkv.config.RowFormat``), GLM-5 sizes in brackets:

    fp8    [D_L = kv_lora (512)]    float8_e4m3fn   values, group g = dims [128 g, 128 g + 128)
    scale  [G = D_L / 128 (4)]      float32         one per group
    rope   [D_R (64)]               bfloat16

dequant: ``bf16(float32(fp8) * scale)`` for the latent part, rope copied: [S, D_L + D_R] bfloat16.
quant:   ``scale = amax / 448`` (fp32, IEEE division), ``fp8 = rne(clamp(x / scale, +-448))``
         (a zero group stores scale 0 and zeros), rope rounded to bfloat16.

The wrappers receive typed views of the byte rows (made by ``cpkv.attention.quant``) so the
kernels never do pointer casts. Triton is imported lazily by :func:`load`.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

import torch

GROUP = 128
# (rows per program, warps) of each kernel: the fastest shape of `cpkv bench attention --sweep` (BENCHMARKS.md)
DEQUANT_LAUNCH = (8, 4)
QUANT_LAUNCH = (8, 4)


@lru_cache(maxsize=1)
def load() -> tuple[Any, Any]:
    """(dequant kernel, quant kernel), compiled on demand."""
    import triton
    import triton.language as tl

    @triton.jit
    def _dequant(
        FP8, SCALE, ROPE, OUT, S, stride_f, stride_s, stride_r, stride_o,
        G: tl.constexpr, D_R: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        # [BLOCK_S, G, 128] tiles: each group's scale is loaded once per thread and broadcast over the
        # group's values in registers (a [BLOCK_S, G] load), not once per value
        rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        rmask = rows < S
        r64 = rows.to(tl.int64)
        offs_g = tl.arange(0, G)
        lat = (offs_g[:, None] * 128 + tl.arange(0, 128)[None, :])[None, :, :]
        m3 = rmask[:, None, None]
        x = tl.load(FP8 + r64[:, None, None] * stride_f + lat, mask=m3, other=0.0)
        sc = tl.load(SCALE + r64[:, None] * stride_s + offs_g[None, :], mask=rmask[:, None], other=0.0)
        y = x.to(tl.float32) * sc[:, :, None]
        tl.store(OUT + r64[:, None, None] * stride_o + lat, y.to(tl.bfloat16, fp_downcast_rounding="rtne"), mask=m3)
        if D_R > 0:
            offs_r = tl.arange(0, D_R)[None, :]
            rope = tl.load(ROPE + r64[:, None] * stride_r + offs_r, mask=rmask[:, None], other=0.0)
            tl.store(OUT + r64[:, None] * stride_o + G * 128 + offs_r, rope, mask=rmask[:, None])

    @triton.jit
    def _quant(
        X, FP8, SCALE, ROPE, S, stride_x, stride_f, stride_s, stride_r,
        D_L: tl.constexpr, G: tl.constexpr, D_R: tl.constexpr, BLOCK_S: tl.constexpr,
    ):
        # [BLOCK_S, G, 128] tiles, as in _dequant: the group max is a reduction over the last axis and the
        # scale broadcasts back over it in registers (no reshape of a [BLOCK_S, D_L] tile)
        rows = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
        rmask = rows < S
        r64 = rows.to(tl.int64)
        offs_g = tl.arange(0, G)
        lat = (offs_g[:, None] * 128 + tl.arange(0, 128)[None, :])[None, :, :]
        m3 = rmask[:, None, None]
        x = tl.load(X + r64[:, None, None] * stride_x + lat, mask=m3, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x), 2)
        scale = tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))
        safe = tl.where(scale > 0.0, scale, 1.0)
        v = tl.minimum(tl.maximum(tl.math.div_rn(x, tl.broadcast_to(safe[:, :, None], x.shape)), -448.0), 448.0)
        tl.store(FP8 + r64[:, None, None] * stride_f + lat, v.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=m3)
        tl.store(SCALE + r64[:, None] * stride_s + offs_g[None, :], scale, mask=rmask[:, None])
        if D_R > 0:
            offs_r = tl.arange(0, D_R)[None, :]
            rope = tl.load(X + r64[:, None] * stride_x + D_L + offs_r, mask=rmask[:, None], other=0.0)
            tl.store(ROPE + r64[:, None] * stride_r + offs_r, rope.to(tl.bfloat16, fp_downcast_rounding="rtne"),
                     mask=rmask[:, None])

    return _dequant, _quant


def supported(d_l: int, d_r: int) -> bool:
    """Power-of-two field widths (``tl.arange`` needs them); other shapes use the torch path."""
    groups = d_l // GROUP
    return groups >= 1 and groups & (groups - 1) == 0 and (d_r == 0 or d_r & (d_r - 1) == 0)


def dequant(fp8: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor,
            launch: tuple[int, int] | None = None) -> torch.Tensor:
    """fp8 [S, D_L] float8_e4m3fn, scale [S, G] float32, rope [S, D_R] bfloat16 (views) -> [S, D_L + D_R] bf16.
    launch: (rows per program, warps), default DEQUANT_LAUNCH."""
    block_s, warps = launch or DEQUANT_LAUNCH
    s, d_l = fp8.shape
    d_r = rope.shape[1]
    out = torch.empty((s, d_l + d_r), dtype=torch.bfloat16, device=fp8.device)
    if s:
        kernel = load()[0]
        kernel[(triton_cdiv(s, block_s),)](
            fp8, scale, rope, out, s, fp8.stride(0), scale.stride(0), rope.stride(0), out.stride(0),
            G=d_l // GROUP, D_R=d_r, BLOCK_S=block_s, num_warps=warps,
        )
    return out


def quant(x: torch.Tensor, fp8: torch.Tensor, scale: torch.Tensor, rope: torch.Tensor,
          launch: tuple[int, int] | None = None) -> None:
    """x [S, D_L + D_R] float -> writes the typed views fp8 [S, D_L], scale [S, G], rope [S, D_R] in place.
    launch: (rows per program, warps), default QUANT_LAUNCH."""
    block_s, warps = launch or QUANT_LAUNCH
    s, d_l = fp8.shape
    if s:
        kernel = load()[1]
        kernel[(triton_cdiv(s, block_s),)](
            x, fp8, scale, rope, s, x.stride(0), fp8.stride(0), scale.stride(0), rope.stride(0),
            D_L=d_l, G=d_l // GROUP, D_R=rope.shape[1], BLOCK_S=block_s, num_warps=warps,
        )


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)

"""Token-KV rows (656-B fp8 layout for GLM-5) to bfloat16 and back; Triton where the backends run it, else torch.

Row layout (``cpkv.config.RowFormat``): D_L fp8 e4m3 | D_L/128 float32 scales | D_R bfloat16 rope.
GLM-5: 512 + 16 + 128 = 656 B <-> 576 bf16 dims; tiny preset: 128 + 4 + 64 = 196 B <-> 160 dims.
"""
from __future__ import annotations

import torch

from cpkv.attention.checks import check_tensor, expect
from cpkv.config import QUANT_GROUP, RowFormat
from cpkv.kernels.platform import Backends, backends_for
from cpkv.kernels.token_kv import ref

FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def dequant_token_kv(rows: torch.Tensor, fmt: RowFormat | None = None, backends: Backends | None = None
                     ) -> torch.Tensor:
    """rows uint8 [S, row_bytes] -> bfloat16 [S, D_L + D_R]: ``bf16(fp32(fp8) * scale)`` then rope.

    ``fmt`` defaults to the GLM-5 token format (656 B -> 576 dims). Bit-identical on both backends (``backends``:
    the caller's; None: ``backends_for(rows)``, as every entry point here).
    """
    fmt = _check_format(fmt)
    check_tensor("rows", rows, 2, (torch.uint8,))
    if rows.shape[1] != fmt.row_bytes:  # messages built only on failure (these run once per layer)
        expect(False, f"rows of {fmt.row_bytes} bytes for {fmt}", rows.shape[1])
    if rows.stride(1) != 1 or rows.stride(0) % 4:
        rows = rows.contiguous()
    if not ((backends or backends_for(rows)).triton and _kernel_fits(fmt)):
        return ref.dequant_token_kv_ref(rows, fmt)
    from cpkv.kernels.token_kv import triton as token_kv

    return token_kv.dequant(*ref.row_views(rows, fmt))


def quant_token_kv(kv: torch.Tensor, fmt: RowFormat | None = None, backends: Backends | None = None) -> torch.Tensor:
    """kv float [S, D_L + D_R] -> uint8 [S, row_bytes] (scale = amax / 448 per 128-value group).

    A zero group stores scale 0 and zero values; values are clamped to +-448 then rounded to
    nearest-even e4m3; rope is rounded to bfloat16. Bit-identical on both backends.
    """
    fmt = _check_format(fmt)
    check_tensor("kv", kv, 2, FLOAT_DTYPES)
    width = fmt.fp8_bytes + fmt.rope_dims
    if kv.shape[1] != width:
        expect(False, f"kv of {width} dims for {fmt}", f"shape {tuple(kv.shape)}")
    if not ((backends or backends_for(kv)).triton and _kernel_fits(fmt)):
        return ref.quant_token_kv_ref(kv, fmt)
    from cpkv.kernels.token_kv import triton as token_kv

    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    rows = torch.empty((kv.shape[0], fmt.row_bytes), dtype=torch.uint8, device=kv.device)
    token_kv.quant(kv, *ref.row_views(rows, fmt))
    return rows


def token_rows(kv: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, eps: float,
               fmt: RowFormat | None = None, backends: Backends | None = None) -> torch.Tensor:
    """A layer's kv_a output kv float [T, D_L + D_R], the latent norm's weight [D_L], the rotation's cos / sin
    float32 [T, D_R / 2] -> uint8 token rows [T, row_bytes]: ``quant_token_kv`` of (RMSNorm(latent) * weight |
    the interleaved RoPE of the rope key), both in kv's dtype (``cpkv.kernels.token_rows.ref``).

    One Triton kernel where the backends run Triton (``cpkv.kernels.token_rows``: rope bytes equal, the latent within one ulp before
    its quantisation: only its sum of squares runs in another order); elsewhere the reference's torch ops."""
    from cpkv.kernels.token_rows import ref as rows_ref

    fmt = _check_format(fmt)
    check_tensor("kv", kv, 2, FLOAT_DTYPES)
    if kv.shape[1] != fmt.fp8_bytes + fmt.rope_dims:
        expect(False, f"kv of {fmt.fp8_bytes + fmt.rope_dims} dims for {fmt}", f"shape {tuple(kv.shape)}")
    if not ((backends or backends_for(kv)).triton and _rows_kernel_fits(fmt)):
        return rows_ref.token_rows_ref(kv, weight, cos, sin, eps, fmt)
    from cpkv.kernels.token_rows import triton as kern

    kv = kv if kv.stride(1) == 1 else kv.contiguous()
    rows = torch.empty((kv.shape[0], fmt.row_bytes), dtype=torch.uint8, device=kv.device)
    kern.token_rows(kv, weight.contiguous(), cos.contiguous(), sin.contiguous(), eps, *ref.row_views(rows, fmt))
    return rows


def _rows_kernel_fits(fmt: RowFormat) -> bool:
    from cpkv.kernels.token_rows import triton as kern

    return kern.supported(fmt.fp8_bytes, fmt.rope_dims)


def _check_format(fmt: RowFormat | None) -> RowFormat:
    fmt = fmt or ref.GLM5_TOKEN
    expect(isinstance(fmt, RowFormat), "fmt to be a cpkv.config.RowFormat", type(fmt).__name__)
    groups = fmt.fp8_bytes // QUANT_GROUP
    if not (fmt.fp8_bytes > 0 and groups * QUANT_GROUP == fmt.fp8_bytes and fmt.scale_count == groups):
        expect(False, f"a format with one float32 scale per {QUANT_GROUP} fp8 values", fmt)
    return fmt


def _kernel_fits(fmt: RowFormat) -> bool:
    from cpkv.kernels.token_kv import triton as token_kv

    return token_kv.supported(fmt.fp8_bytes, fmt.rope_dims)

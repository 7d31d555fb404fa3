"""Token-KV row (de)quantisation, pure torch: the semantics the Triton kernel matches, and the CPU path.

Token row (``cpkv.config.RowFormat``; GLM-5: 512 + 16 + 128 = 656 B):

    [0, D_L)              float8_e4m3fn values, group g covers dims [128 g, 128 g + 128)
    [D_L, D_L + 4 G)      float32 scales, G = D_L / 128
    [D_L + 4 G, row)      bfloat16 rope, D_R values
"""
from __future__ import annotations

import torch

from cpkv.config import QUANT_GROUP, RowFormat

FP8_MAX = 448.0
GLM5_TOKEN = RowFormat(512, 4, 64)


def row_views(rows: torch.Tensor, fmt: RowFormat) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """rows uint8 [S, row_bytes] -> typed views (fp8 [S, D_L], scale fp32 [S, G], rope bf16 [S, D_R]).

    The views share the rows' storage (no copy), so they can be written through.
    """
    fp8 = rows[:, : fmt.fp8_bytes].view(torch.float8_e4m3fn)
    scale = rows[:, fmt.scale_offset : fmt.rope_offset].view(torch.float32)
    rope = rows[:, fmt.rope_offset : fmt.row_bytes].view(torch.bfloat16)
    return fp8, scale, rope


def dequant_token_kv_ref(rows: torch.Tensor, fmt: RowFormat = GLM5_TOKEN) -> torch.Tensor:
    """rows uint8 [S, row_bytes] -> bfloat16 [S, D_L + D_R]: ``bf16(fp32(fp8) * scale)`` | rope."""
    fp8, scale, rope = row_views(rows, fmt)
    latent = fp8.float() * scale.repeat_interleave(QUANT_GROUP, dim=1)
    return torch.cat([latent.to(torch.bfloat16), rope], dim=1)


def quant_token_kv_ref(kv: torch.Tensor, fmt: RowFormat = GLM5_TOKEN) -> torch.Tensor:
    """kv float [S, D_L + D_R] -> uint8 [S, row_bytes].

    scale = amax / 448 per 128-value group (float32); values rne(clamp(x / scale, +-448)) in e4m3;
    a group of zeros stores scale 0 and zero values; rope rounded to bfloat16.
    """
    s = kv.shape[0]
    d_l = fmt.fp8_bytes
    rows = torch.empty((s, fmt.row_bytes), dtype=torch.uint8, device=kv.device)
    fp8, scale, rope = row_views(rows, fmt)
    x = kv[:, :d_l].float().reshape(s, fmt.scale_count, QUANT_GROUP)
    amax = x.abs().amax(dim=2)
    sc = amax / torch.full_like(amax, FP8_MAX)  # tensor / tensor: IEEE division on every device
    safe = torch.where(sc > 0, sc, torch.ones_like(sc))
    vals = (x / safe[:, :, None]).clamp(-FP8_MAX, FP8_MAX).reshape(s, d_l)
    fp8.copy_(vals.to(torch.float8_e4m3fn))
    scale.copy_(sc)
    rope.copy_(kv[:, d_l:].to(torch.bfloat16))
    return rows

"""Block-scaled fp8 GEMMs, pure torch: the references the kernels are tested against, and the path off CUDA.

DeepSeek / GLM-5 block format (``weight_block_size`` [128, 128]):

    weight        float8_e4m3fn [N, K]                       value = fp8 * scale_inv[n // 128, k // 128]
    scale_inv     float32 [ceil(N / 128), ceil(K / 128)]
    activation    float8_e4m3fn [M, K], scale float32 [M, ceil(K / 128)]: one scale per token per 1 x 128
                  group; scale = amax / 448 (a zero group: scale 0, values 0), fp8 = rne(x / scale)

    fp8_linear_ref(x [M, K], w, w_scale) -> [M, N] x's dtype: x @ dequant(w)^T in float32, rounded once
    grouped_fp8_ref(xq, xs, offs, w [E, N, K], w_scale [E, N/128, K/128]) -> float32 [R, N]: row i of local
        expert e (offs[e-1] <= i < offs[e]) times expert e's dequantised weight; rows past offs[-1]: 0
"""
from __future__ import annotations

import torch

BLOCK = 128
FP8_MAX = 448.0


def dequant_blocks(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """fp8 [..., N, K] with float32 block scales [..., ceil(N/128), ceil(K/128)] -> [..., N, K] ``dtype``."""
    n, k = w.shape[-2:]
    s = scale.float().repeat_interleave(BLOCK, -2)[..., :n, :].repeat_interleave(BLOCK, -1)[..., :k]
    return (w.float() * s).to(dtype)


def act_quant_ref(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] float -> (float8_e4m3fn [M, K], float32 scale [M, ceil(K/128)]), per token per 1 x 128 group."""
    m, k = x.shape
    g = -(-k // BLOCK)
    padded = torch.zeros(m, g * BLOCK, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(m, g, BLOCK)
    amax = groups.abs().amax(dim=-1)
    # the IEEE quotient amax / 448 on every device: a tensor divisor, because torch on CUDA turns a division
    # by a Python (CPU) scalar into amax * fl(1 / 448), which differs from the quotient by one ulp at times
    scale = amax / torch.full_like(amax, FP8_MAX)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (groups / safe[..., None]).clamp(-FP8_MAX, FP8_MAX).view(m, g * BLOCK)[:, :k]
    return q.to(torch.float8_e4m3fn), scale


def act_dequant_ref(xq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(fp8 [M, K], float32 [M, ceil(K/128)]) -> float32 [M, K]."""
    k = xq.shape[-1]
    return xq.float() * scale.float().repeat_interleave(BLOCK, -1)[..., :k]


def fp8_linear_ref(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] (unquantised) @ dequant(w [N, K])^T in float32 -> [M, N] in x's dtype (the path off CUDA and
    where ``torch._scaled_mm``'s shape rules are not met: the activation is not quantised)."""
    return (x.float() @ dequant_blocks(w, w_scale).t()).to(x.dtype)


def fp8_linear_quant_ref(xq: torch.Tensor, xs: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """The block-scaled GEMM itself: dequant(xq, xs) @ dequant(w, w_scale)^T -> float32 [M, N]."""
    return act_dequant_ref(xq, xs) @ dequant_blocks(w, w_scale).t()


def grouped_fp8_ref(xq: torch.Tensor, xs: torch.Tensor, offs: torch.Tensor, w: torch.Tensor,
                    w_scale: torch.Tensor) -> torch.Tensor:
    """xq fp8 [R, K], xs float32 [R, ceil(K/128)] sorted by expert, offs int32 [E] row ends, w fp8 [E, N, K],
    w_scale float32 [E, ceil(N/128), ceil(K/128)] -> float32 [R, N] (rows past offs[-1]: 0). One expert at a
    time; reads the offsets back to the host."""
    out = torch.zeros(xq.shape[0], w.shape[1], dtype=torch.float32, device=xq.device)
    ends = offs.tolist()
    a = act_dequant_ref(xq, xs)
    for e, (s, t) in enumerate(zip([0] + ends[:-1], ends)):
        if t > s:
            out[s:t] = a[s:t] @ dequant_blocks(w[e], w_scale[e]).t()
    return out

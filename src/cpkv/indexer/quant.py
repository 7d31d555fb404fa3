"""fp8 quantisation of indexer keys and queries.

Index row (docs/design.md §1, ``ModelConfig.index_format``), D = index_head_dim:

    bytes [0, D)      D float8_e4m3fn values  k_fp8[j] = k[j] / k_scale[j]
    bytes [D, D + 4)  one float32 scale       k_scale[j] = amax(|k[j]|) / 448   (little-endian)

GLM-5 / DeepSeek-V3.2: D = 128, so 132 B per token.

Queries get one scale per (token, head); since relu(s * x) = s * relu(x) for s > 0 it is folded
into the indexer weights: weights_folded[t, h] = weights[t, h] * q_scale[t, h].

``head_weights``: the head weights from the layer's input (``weights_proj`` in float32, no float32 copy of x).
``prepare_index_keys`` / ``prepare_index_queries``: the layer's whole way from the projections (LayerNorm of the
keys, RoPE on the first dims, Hadamard rotation, quantisation): one Triton kernel each where the caller's backends
run Triton (``cpkv.kernels.index_rows``), the torch ops of ``cpkv.kernels.index_rows.ref`` elsewhere (``backends``
None: ``cpkv.kernels.platform.backends_for`` of the input).
"""
from __future__ import annotations

import torch

from cpkv.errors import IndexerError
from cpkv.kernels.index_rows import ref
from cpkv.kernels.platform import Backends, backends_for

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
MIN_SCALE = 1e-10  # keeps an all-zero row finite (its fp8 values are then all 0)


def _amax_scale(x: torch.Tensor) -> torch.Tensor:
    """x: [..., D] float -> float32 [...] scale = amax(|x|) / 448 (at least MIN_SCALE).

    Divided by a tensor, not a Python number: CUDA turns division by a scalar into a multiplication by its
    reciprocal (one ulp off at times), so only tensor / tensor gives the same bytes on every device.
    amax(|x|) is the infinity norm (one reduction, exact: no float32 |x| copy of [T, H, D] queries first)."""
    amax = torch.linalg.vector_norm(x.float(), ord=float("inf"), dim=-1)
    return (amax / torch.full_like(amax, FP8_MAX)).clamp_(min=MIN_SCALE)


def quantize_index_keys(k: torch.Tensor) -> torch.Tensor:
    """k: [S, D] float/bf16 -> uint8 [S, D + 4] index rows (module docstring layout). D % 4 == 0."""
    if k.dim() != 2 or k.shape[1] % 4:
        raise IndexerError(f"index keys must be [S, D] with D % 4 == 0, got shape {tuple(k.shape)}")
    scale = _amax_scale(k)
    rows = torch.empty(k.shape[0], k.shape[1] + 4, dtype=torch.uint8, device=k.device)
    rows[:, : k.shape[1]] = (k.float() / scale[:, None]).to(FP8).view(torch.uint8)
    rows[:, k.shape[1]:] = scale[:, None].view(torch.uint8)
    return rows


def dequantize_index_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows: uint8 [S, D + 4] -> (k_fp8 float8_e4m3fn [S, D], k_scale float32 [S]), both views of
    ``rows`` (no copy): k_fp8 has row stride D + 4 bytes, k_scale stride (D + 4) / 4 elements."""
    if rows.dtype != torch.uint8 or rows.dim() != 2 or rows.shape[1] < 8 or rows.shape[1] % 4:
        raise IndexerError(
            f"index rows must be uint8 [S, D + 4] with D % 4 == 0, got {rows.dtype} {tuple(rows.shape)}"
        )
    if rows.stride(1) != 1 or rows.stride(0) % 4 or rows.storage_offset() % 4:
        raise IndexerError(f"index rows must have unit column stride and 4-byte aligned rows, got strides {rows.stride()}")
    d = rows.shape[1] - 4
    return rows[:, :d].view(FP8), rows[:, d:].view(torch.float32)[:, 0]


def dequantize_index_keys(rows: torch.Tensor) -> torch.Tensor:
    """rows: uint8 [S, D + 4] -> float32 [S, D] = k_fp8 * k_scale (for tests and references)."""
    k_fp8, k_scale = dequantize_index_rows(rows)
    return k_fp8.float() * k_scale[:, None]


def quantize_queries(q: torch.Tensor, weights: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, H, D] float/bf16, weights: [T, H] float -> (q_fp8 float8_e4m3fn [T, H, D],
    weights_folded float32 [T, H] = weights * q_scale), q_scale[t, h] = amax(|q[t, h]|) / 448."""
    if q.dim() != 3 or weights.shape != q.shape[:2]:
        raise IndexerError(
            f"expected q [T, H, D] and weights [T, H], got {tuple(q.shape)} and {tuple(weights.shape)}"
        )
    scale = _amax_scale(q)
    q_fp8 = (q.float() / scale[..., None]).to(FP8)
    return q_fp8, weights.float() * scale


def prepare_index_keys(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor, rope_dims: int, interleaved: bool, eps: float = 1e-6,
                       backends: Backends | None = None) -> torch.Tensor:
    """k [T, D] (the wk projection), LayerNorm weight / bias [D], cos / sin float32 [T, rope_dims / 2] -> uint8
    index rows [T, D + 4] of the normed, first-dims-rotated, Hadamard-rotated keys (module docstring)."""
    if k.dim() != 2 or k.shape[1] % 4:
        raise IndexerError(f"index keys must be [S, D] with D % 4 == 0, got shape {tuple(k.shape)}")
    if not ((backends or backends_for(k)).triton and _fits(k.shape[1], rope_dims)):
        return ref.index_keys_ref(k, weight, bias, cos, sin, rope_dims, interleaved, eps)
    from cpkv.kernels.index_rows import triton as kern

    t, d = k.shape
    rows = torch.empty(t, d + 4, dtype=torch.uint8, device=k.device)
    fp8, scale = dequantize_index_rows(rows)
    kern.index_rows(_unit_cols(k), 1, cos, sin, rope_dims, interleaved, fp8, scale,
                    norm=(weight.contiguous(), bias.contiguous(), eps))
    return rows


def prepare_index_queries(q: torch.Tensor, weights: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                          rope_dims: int, interleaved: bool, backends: Backends | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, H, D] (the wq_b projection), weights float32 [T, H] -> (fp8 [T, H, D], weights_folded float32 [T, H])
    of the first-dims-rotated, Hadamard-rotated queries (``quantize_queries`` after the rotations)."""
    if q.dim() != 3 or weights.shape != q.shape[:2]:
        raise IndexerError(f"expected q [T, H, D] and weights [T, H], got {tuple(q.shape)} and {tuple(weights.shape)}")
    if not ((backends or backends_for(q)).triton and _fits(q.shape[2], rope_dims)):
        return ref.index_queries_ref(q, weights, cos, sin, rope_dims, interleaved)
    from cpkv.kernels.index_rows import triton as kern

    t, h, d = q.shape
    q_fp8 = torch.empty(t, h, d, dtype=FP8, device=q.device)
    folded = torch.empty(t, h, dtype=torch.float32, device=q.device)
    kern.index_rows(_unit_cols(q).reshape(t * h, d), h, cos, sin, rope_dims, interleaved, q_fp8.view(t * h, d),
                    folded.view(-1), weights=weights.float().contiguous().view(-1))
    return q_fp8, folded


def head_weights(x: torch.Tensor, weight: torch.Tensor, scale: float, backends: Backends | None = None
                 ) -> torch.Tensor:
    """x [T, K] (the layer's normed input, compute dtype), weight float32 [N, K] (``weights_proj``) -> float32
    [T, N] = F.linear(float32(x), weight) * scale: a Triton kernel reading x as it is (no float32 copy; float32
    products and sums, in another order than cuBLAS's: within float32 rounding of it)."""
    if not ((backends or backends_for(x)).triton and x.dim() == 2 and weight.dtype == torch.float32):
        return ref.head_weights_ref(x, weight, scale)
    from cpkv.kernels.index_rows import triton as kern

    out = torch.empty(x.shape[0], weight.shape[0], dtype=torch.float32, device=x.device)
    kern.head_weights(_unit_cols(x), weight.contiguous(), scale, out)
    return out


def _fits(d: int, rope_dims: int) -> bool:
    from cpkv.kernels.index_rows import triton as kern

    return kern.supported(d, rope_dims)


def _unit_cols(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()

"""The indexer's key rows and quantised queries, pure torch: the ops the fused kernel replaces, in their order.

    hadamard_rotate(x [..., n] float, n a power of two) -> float32 x @ H_n / sqrt(n) (Sylvester order)
    rope_first(x [..., D] float32, cos, sin float32 [T, r / 2], r, interleaved) -> float32 [..., D]
        the first r dims rotated (pairs (x[2i], x[2i+1]) or halves (x[i], x[i + r/2]): (a c - b s, a s + b c)),
        the rest passed (x's first dim is the token)
    index_keys_ref(k [T, D], weight [D], bias [D], cos, sin, r, interleaved, eps)
        -> uint8 [T, D + 4] = quantize_index_keys(hadamard_rotate(rope_first(LayerNorm(k)))) (index row layout)
    head_weights_ref(x [T, K], w float32 [N, K], scale) -> float32 [T, N] = F.linear(float32(x), w) * scale
    index_queries_ref(q [T, H, D], weights float32 [T, H], cos, sin, r, interleaved)
        -> (fp8 [T, H, D], float32 [T, H]) = quantize_queries(hadamard_rotate(rope_first(q)), weights)
"""
from __future__ import annotations

from functools import lru_cache

import torch
import torch.nn.functional as F


FP8_MAX, MIN_SCALE = 448.0, 1e-10  # cpkv.indexer.quant's (not imported: it dispatches here)


@lru_cache(maxsize=8)
def _hadamard(n: int, device: str) -> torch.Tensor:
    """float32 [n, n] H_n / sqrt(n) in Sylvester order on ``device`` (built once per size and device)."""
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h * n ** -0.5).to(device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] float, n a power of two -> x @ H_n / sqrt(n) (the indexer's ``rotate_activation``)."""
    n = x.shape[-1]
    assert n & (n - 1) == 0, f"Hadamard rotation needs a power-of-two width, got {n}"
    return x.float() @ _hadamard(n, str(x.device))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x float32 [..., D] -> (fp8 [..., D], scale float32 [...]): ``cpkv.indexer.quant``'s rule, scale =
    max(amax / 448 (IEEE quotient), 1e-10), fp8 = rne(x / scale) (tests hold the two to the same bytes)."""
    amax = x.abs().amax(dim=-1)
    scale = (amax / torch.full_like(amax, FP8_MAX)).clamp_(min=MIN_SCALE)
    return (x / scale[..., None]).to(torch.float8_e4m3fn), scale


def rope_first(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int, interleaved: bool) -> torch.Tensor:
    """(module docstring) separate float32 products and sums, as ``Rotary.interleaved_ref`` / ``halves_ref``."""
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.view(shape), sin.view(shape)
    xf = x.float()
    if interleaved:
        pairs = xf[..., :r].unflatten(-1, (-1, 2))
        a, b = pairs[..., 0], pairs[..., 1]
        rot = torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)
    else:
        a, b = xf[..., :r].chunk(2, dim=-1)
        rot = torch.cat((a * c - b * s, a * s + b * c), dim=-1)
    return torch.cat((rot, xf[..., r:]), dim=-1)


def index_keys_ref(k: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   r: int, interleaved: bool, eps: float = 1e-6) -> torch.Tensor:
    """uint8 index rows [T, D + 4] (module docstring)."""
    kn = F.layer_norm(k.float(), (k.shape[-1],), weight.float(), bias.float(), eps)
    fp8, scale = quantize_rows(hadamard_rotate(rope_first(kn, cos, sin, r, interleaved)))
    rows = torch.empty(k.shape[0], k.shape[1] + 4, dtype=torch.uint8, device=k.device)
    rows[:, : k.shape[1]] = fp8.view(torch.uint8)
    rows[:, k.shape[1]:] = scale[:, None].view(torch.uint8)
    return rows


def index_queries_ref(q: torch.Tensor, weights: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, r: int,
                      interleaved: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 queries [T, H, D], folded weights float32 [T, H]) (module docstring)."""
    fp8, scale = quantize_rows(hadamard_rotate(rope_first(q, cos, sin, r, interleaved)))
    return fp8, weights.float() * scale


def head_weights_ref(x: torch.Tensor, w: torch.Tensor, scale: float) -> torch.Tensor:
    """The indexer's head weights float32 [T, N] (module docstring)."""
    return F.linear(x.float(), w.float()) * scale

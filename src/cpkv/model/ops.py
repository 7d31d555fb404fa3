"""Small tensor ops of the DSA model: norms, rotary embeddings, the Hadamard rotation, SwiGLU.

Rotary embeddings follow the DeepSeek-V3.2 reference: MLA rotates *interleaved* pairs (x[2i], x[2i+1]);
the indexer rotates *halves* (x[i], x[i + d/2]). ``Rotary`` holds cos/sin for one batch's positions,
built once per batch and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] -> same dtype as x; computed in float32."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., d] -> float32 LayerNorm (the indexer's k_norm)."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)


def swiglu_mlp(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """x [T, d] -> [T, d]: down(silu(gate x) * up x)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


@dataclass(frozen=True)
class Rotary:
    """cos/sin float32 [T, rope_dim / 2] of one batch's token positions."""

    cos: torch.Tensor
    sin: torch.Tensor

    @classmethod
    def build(cls, positions: torch.Tensor, rope_dim: int, theta: float) -> "Rotary":
        """positions int [T] -> Rotary with angles pos * theta^(-2i / rope_dim)."""
        inv = theta ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64, device=positions.device) / rope_dim)
        ang = positions.to(torch.float64)[:, None] * inv[None, :]
        return cls(torch.cos(ang).float(), torch.sin(ang).float())

    def _cs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (self.cos.shape[1],)
        return self.cos.view(shape), self.sin.view(shape)

    def interleaved(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ..., r] (pairs x[2i], x[2i+1]) -> rotated, float32."""
        c, s = self._cs(x)
        xf = x.float().unflatten(-1, (-1, 2))
        a, b = xf[..., 0], xf[..., 1]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)

    def halves(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, ..., r] (pairs x[i], x[i + r/2]) -> rotated, float32."""
        c, s = self._cs(x)
        a, b = x.float().chunk(2, dim=-1)
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1)


@lru_cache(maxsize=8)
def _hadamard(n: int, device: str) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float32)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
    return (h * n ** -0.5).to(device)


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """x [..., n] float, n a power of two -> x @ H_n / sqrt(n) (the indexer's ``rotate_activation``)."""
    n = x.shape[-1]
    assert n & (n - 1) == 0, f"Hadamard rotation needs a power-of-two width, got {n}"
    return x.float() @ _hadamard(n, str(x.device))

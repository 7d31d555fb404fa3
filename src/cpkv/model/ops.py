"""Small tensor ops of the DSA model: norms and rotary embeddings (the Hadamard rotation and ``rms_norm_ref`` live
beside their kernels, ``cpkv.kernels.index_rows.ref`` and ``cpkv.kernels.add_norm.ref``, and are re-exported).

Rotary embeddings as transformers' GLM-5 / DeepSeek-V3.2: MLA rotates *interleaved* pairs
(x[2i], x[2i+1]); the indexer rotates interleaved pairs on GLM-5 and *halves* (x[i], x[i + d/2]) on
DeepSeek-V3.2. Frequencies are plain (theta^(-2i/d)) or YaRN's blend of interpolated and extrapolated
ones, and YaRN's attention factor scales cos and sin. ``Rotary`` holds cos/sin (and cos + i sin) for one
batch's positions, built once per batch and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import TYPE_CHECKING

import math

import torch
import torch.nn.functional as F

from cpkv.config import RopeConfig
from cpkv.kernels.add_norm.ref import rms_norm_ref
from cpkv.kernels.index_rows.ref import hadamard_rotate  # noqa: F401  (re-exported: the indexer's rotation)
from cpkv.kernels.platform import Backends, backends_for
from cpkv.upload import upload

if TYPE_CHECKING:
    from cpkv.model.linear import QuantAct


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., d] -> same dtype as x: x * rsqrt(mean(x^2) + eps) * weight in float32, rounded once.

    With ``weight`` in x's dtype this is ``F.rms_norm``: one fused kernel on CUDA (float32 statistics and
    products, one rounding to x's dtype) instead of six float32 passes over [T, d]; on CPU it runs the same
    float32 ops in the same order as the form below (bit-identical, tested)."""
    if weight.dtype == x.dtype and x.dtype in (torch.bfloat16, torch.float16, torch.float32):
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    return rms_norm_ref(x, weight, eps)


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 quant: bool = False, backends: Backends | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, "QuantAct | None"]:
    """h [T, D], delta [T, D] or None (a residual not yet added) -> (h' = h + delta [T, D], x = rms_norm(h') [T, D],
    the QuantAct of x when ``quant`` (fp8 1 x 128 groups, ``cpkv.model.linear.quant_act``'s bytes for this x)).

    One Triton kernel where ``backends`` (None: ``backends_for(h)``) run Triton (``cpkv.kernels.add_norm``: the
    add, the norm and the quantisation in one pass, x within one ulp of ``rms_norm``'s: only the order of the sum
    of squares differs); elsewhere the torch ops it replaces (``add_rms_norm_ref``'s order: add, ``rms_norm``,
    ``quant_act``)."""
    from cpkv.model.linear import QuantAct, empty_quant, quant_act

    backends = backends or backends_for(h)
    if backends.triton and _norm_fusable(h, delta, weight):
        from cpkv.kernels.add_norm import triton as kern

        t, d = h.shape
        hs = h if delta is None else torch.empty(h.shape, dtype=h.dtype, device=h.device)
        x = torch.empty(h.shape, dtype=h.dtype, device=h.device)
        q, s = empty_quant(t, d, h.device) if quant else (None, None)
        kern.add_rms_norm(h, delta, weight, eps, None if delta is None else hs, x, q, s)
        return hs, x, QuantAct(q, s, x.dtype, x) if quant else None
    hs = h if delta is None else h + delta
    x = rms_norm(hs, weight, eps)
    return hs, x, quant_act(x, backends) if quant else None


def _norm_fusable(h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """True when the fused kernel takes these tensors: rows of unit column stride, delta like h, weight [D]."""
    ok = h.dim() == 2 and h.stride(-1) == 1 and weight.shape == (h.shape[1],) and weight.stride(0) == 1
    return ok and (delta is None or delta.shape == h.shape and delta.dtype == h.dtype and delta.stride(-1) == 1)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x [..., d] -> float32 LayerNorm (the indexer's k_norm)."""
    return F.layer_norm(x.float(), (x.shape[-1],), weight.float(), bias.float(), eps)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction 0.1 mscale ln(scale) + 1 (1 for scale <= 1)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


@lru_cache(maxsize=32)
def _frequencies_on(rope: RopeConfig, dim: int, device: torch.device) -> tuple[torch.Tensor, float]:
    """``rope_frequencies`` with inv_freq on ``device``: computed and uploaded once (every batch's rotary tables
    use it)."""
    inv, attention = rope_frequencies(rope, dim)
    return upload(inv, device), attention  # asynchronous: a pageable copy would drain the stream


def rope_frequencies(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """-> (inv_freq float32 [dim / 2], attention factor), in transformers' float32 arithmetic."""
    pos_freqs = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    if rope.type == "default":
        return 1.0 / pos_freqs, 1.0
    factor, original = rope.factor, rope.original_max_position_embeddings
    attention = rope.attention_factor
    if attention is None:
        attention = (yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
                     if rope.mscale and rope.mscale_all_dim else yarn_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attention)


def softmax_scale(rope: RopeConfig, qk_head_dim: int) -> float:
    """MLA softmax scale: qk_head_dim^-1/2, times yarn_mscale(factor, mscale_all_dim)^2 under YaRN."""
    scale = qk_head_dim ** -0.5
    if rope.type != "default" and rope.mscale_all_dim:
        scale *= yarn_mscale(rope.factor, rope.mscale_all_dim) ** 2
    return scale


def _complex_pairs(x: torch.Tensor) -> torch.Tensor:
    """float32 [..., r] -> complex64 view [..., r / 2] of its pairs (x[2i], x[2i+1]) (a copy when the strides
    do not allow a view)."""
    if x.stride(-1) != 1 or x.storage_offset() % 2 or any(s % 2 for s in x.stride()[:-1]):
        x = x.contiguous()
    return torch.view_as_complex(x.unflatten(-1, (-1, 2)))


@dataclass(frozen=True)
class Rotary:
    """cos/sin float32 [T, rope_dim / 2] of one batch's token positions (attention factor included), and
    ``cis`` = cos + i sin (complex64, built on first use, once) for the torch form of the interleaved rotation
    (the fused RoPE kernels read cos and sin: a batch on them never builds it)."""

    cos: torch.Tensor
    sin: torch.Tensor
    _cis: list = field(default_factory=list, repr=False, compare=False)

    @property
    def cis(self) -> torch.Tensor:
        if not self._cis:
            self._cis.append(torch.complex(self.cos, self.sin))
        return self._cis[0]

    @classmethod
    def build(cls, positions: torch.Tensor, rope_dim: int, rope: RopeConfig | float) -> "Rotary":
        """positions int [T] -> Rotary with angles pos * inv_freq (``rope``: a RopeConfig or a plain theta)."""
        rope = rope if isinstance(rope, RopeConfig) else RopeConfig(theta=float(rope))
        inv, attention = _frequencies_on(rope, rope_dim, positions.device)
        ang = positions.to(torch.float32)[:, None] * inv[None, :]
        cos, sin = torch.cos(ang), torch.sin(ang)
        if attention != 1.0:  # (x * 1.0 is x: the plain RoPE skips two passes)
            cos, sin = cos * attention, sin * attention
        return cls(cos, sin)

    def _shape(self, x: torch.Tensor) -> tuple[int, ...]:
        return (x.shape[0],) + (1,) * (x.dim() - 2) + (self.cos.shape[1],)

    def _cs(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        shape = self._shape(x)
        return self.cos.view(shape), self.sin.view(shape)

    def interleaved(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, ..., r] (pairs x[2i], x[2i+1]) -> rotated, float32 (or written into ``out``, any float dtype,
        rounded once; returns ``out``).

        One complex product (a + ib)(cos + i sin) per pair: real a cos - b sin, imaginary a sin + b cos, the
        products of the stack form (``interleaved_ref``) without its four products, two sums and stack as
        separate float32 passes. A float32 ``out`` whose pairs can be viewed as complex receives the product
        directly."""
        z = _complex_pairs(x.float())
        cis = self.cis.view(self._shape(x))
        if out is not None and out.dtype == torch.float32 and out.stride(-1) == 1 and out.storage_offset() % 2 == 0 \
                and all(s % 2 == 0 for s in out.stride()[:-1]):
            torch.mul(z, cis, out=torch.view_as_complex(out.unflatten(-1, (-1, 2))))
            return out
        y = torch.view_as_real(z * cis).flatten(-2)
        return y if out is None else out.copy_(y)

    def interleaved_into(self, x: torch.Tensor, out: torch.Tensor, backends: Backends | None = None) -> torch.Tensor:
        """x [T, H, r] -> ``out`` [T, H, r] (a slice, any float dtype; returned): the rotation rounded once to out's
        dtype. One Triton kernel where ``backends`` (None: ``backends_for(x)``) run Triton (``cpkv.kernels.rope``:
        ``interleaved_ref``'s separate float32 products, its bytes; ``interleaved``'s complex product may round an
        FMA differently there); elsewhere ``interleaved(x, out=out)`` (bit-identical to ``interleaved_ref`` on
        CPU)."""
        if (backends or backends_for(x)).triton and x.dim() == 3 and x.stride(-1) == 1 and out.stride(-1) == 1:
            from cpkv.kernels.rope import triton as kern

            if kern.supported(x.shape[-1]):
                kern.rope_interleaved(x, self.cos, self.sin, out)
                return out
        return self.interleaved(x, out=out)

    def interleaved_ref(self, x: torch.Tensor) -> torch.Tensor:
        """``interleaved`` as separate float32 products and a stack (the reference of the complex form)."""
        c, s = self._cs(x)
        xf = x.float().unflatten(-1, (-1, 2))
        a, b = xf[..., 0], xf[..., 1]
        return torch.stack((a * c - b * s, a * s + b * c), dim=-1).flatten(-2)

    def halves(self, x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """x [T, ..., r] (pairs x[i], x[i + r/2]) -> rotated, float32 (or written into ``out``; returns it).

        Each half is computed into its slice of the result (no cat); same products and sums as
        ``halves_ref``."""
        c, s = self._cs(x)
        a, b = x.float().chunk(2, dim=-1)
        y = out if out is not None and out.dtype == torch.float32 else torch.empty(x.shape, dtype=torch.float32,
                                                                                      device=x.device)
        lo, hi = y.chunk(2, dim=-1)
        torch.mul(a, c, out=lo).sub_(b * s)
        torch.mul(a, s, out=hi).add_(b * c)
        return y if out is None or out is y else out.copy_(y)

    def halves_ref(self, x: torch.Tensor) -> torch.Tensor:
        """``halves`` with a cat (the reference)."""
        c, s = self._cs(x)
        a, b = x.float().chunk(2, dim=-1)
        return torch.cat((a * c - b * s, a * s + b * c), dim=-1)

"""Triton sparse MLA prefill attention (reference: ``cpkv.attention.ref.sparse_mla_ref``).

    q       [T, H, d_qk]  bfloat16   d_qk = d_v + d_rope (GLM-5: 512 + 64)
    kv      [S, d_qk]     bfloat16   one latent row per key; values are kv[:, :d_v]
    indices [T, topk]     int32      absolute kv rows; -1 or >= S means "no key"
    out     [T, H, d_v]   bfloat16
    lse     [T, H]        float32    natural log; +inf for a row with no valid key

One program handles one query token and a block of BLOCK_H heads (one flat grid dimension,
head blocks fastest: ``cpkv.kernels.grid.sparse_mla_grid``, any number of tokens): every gathered key tile
``kv[idx[k0:k0+BLOCK_K]]`` is loaded once and used by all BLOCK_H heads (scores: a
[BLOCK_H, d_qk] x [d_qk, BLOCK_K] bf16 dot, fp32 accumulate; then [BLOCK_H, BLOCK_K] x
[BLOCK_K, d_v] for the values, from the same tile). Online softmax in base 2.

The dense causal variant (``DENSE=True``) computes the indices in the kernel: query t reads
rows ``ks[t] .. ke[t]-1`` (the loop bound is read on the device, so no host sync).

Triton is imported lazily by :func:`load`; this module imports on machines without it.

Why the Triton kernel stays below the GEMM rate: Triton's chained-dot heuristic puts all 8 warps on M for
the score dot, and with M = 64 heads both warpgroups compute the same [64, 64] score tile, so the QK half of
the work is done twice and shared-memory reads per tile double. The warp-specialised Gluon kernel
(``gluon_ws.py``, the default on sm_90 for 512 + 64 dims and > 32 heads) splits the work by key block
instead: a producer warpgroup issues the gathers (cp.async completing on mbarriers) and each consumer
warpgroup takes whole 64-key blocks, so one consumer's softmax overlaps the other's wgmma. Speed against
the bf16 GEMM: BENCHMARKS.md (``cpkv bench attention``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from cpkv.kernels.platform import capability, gluon_importable
from cpkv.kernels.grid import sparse_mla_grid

LOG2E = 1.4426950408889634
USE_GLUON_BY_DEFAULT = True  # warp-specialised Gluon kernel: faster and correct on H200 (module docstring)
IMPLS = ("triton", "gluon_ws")  # Config.impl: this module's kernel, or gluon_ws.py's


@dataclass(frozen=True)
class Config:
    """Launch shape: heads per program, keys per tile, warps, software-pipelining depth."""

    block_h: int
    block_k: int
    num_warps: int
    num_stages: int
    # "triton" (any sm_80+) or "gluon_ws" (the default on Hopper: wgmma, blocks of 64 heads, 512 + 64 dims,
    # warp-specialised: producer + two consumers, one program per SM; see gluon_ws.py)
    impl: str = "triton"

    def __post_init__(self) -> None:
        if self.impl not in IMPLS:
            from cpkv.errors import AttentionError

            raise AttentionError(f"sparse MLA kernel: expected impl one of {', '.join(IMPLS)}, got {self.impl!r}")

    def tag(self) -> str:
        """Short name for tables: ``h64 k64 w8 s2 [gluon_ws]``."""
        extra = f" {self.impl}" if self.impl != "triton" else ""
        return f"h{self.block_h} k{self.block_k} w{self.num_warps} s{self.num_stages}{extra}"


GLUON_WS = Config(64, 64, 12, 2, impl="gluon_ws")  # 12 warps; 2 key buffers; one program per SM (the default)


def _pow2_at_least(n: int, lo: int) -> int:
    return max(lo, 1 << max(0, (n - 1).bit_length()))


def gluon_supported(d_v: int, d_rope: int, capability: tuple[int, int] | None) -> bool:
    """Whether the Gluon kernels apply: Hopper (sm_90), d_v = 512, d_rope = 64, Gluon importable."""
    return capability == (9, 0) and (d_v, d_rope) == (512, 64) and gluon_importable()


def default_config(h: int, d_v: int, d_rope: int, capability: tuple[int, int] | None = None) -> Config:
    """Configuration for ``h`` heads and a ``d_v + d_rope`` score width (tuned on H200 for 512 + 64).

    ``capability`` is the device's (major, minor); the Gluon kernels need (9, 0).
    """
    if USE_GLUON_BY_DEFAULT and h > 32 and gluon_supported(d_v, d_rope, capability):
        return GLUON_WS
    block_h = min(64, _pow2_at_least(h, 16))
    if d_v >= 512:
        return Config(block_h, 64, 8, 2) if block_h == 64 else Config(block_h, 64, 4, 2)
    return Config(block_h, 64, 4, 2)


def supported(d_v: int, d_rope: int) -> bool:
    """Whether the kernel handles this split of the score dims (powers of two, dot-sized)."""
    def ok(n: int) -> bool:
        return n >= 16 and n & (n - 1) == 0

    return ok(d_v) and d_v <= 512 and (d_rope == 0 or (ok(d_rope) and d_rope <= 128))


@lru_cache(maxsize=1)
def load() -> Any:
    """Compile-on-demand Triton kernel (imported lazily)."""
    import triton
    import triton.language as tl

    @triton.jit
    def _sparse_mla_fwd(
        Q, KV, IDX, KS, KE, OUT, LSE,
        S, H, TOPK, scale_log2,
        stride_qt, stride_qh, stride_kv, stride_it, stride_ot, stride_oh, stride_lt,
        D_V: tl.constexpr, D_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr,
        DENSE: tl.constexpr,
    ):
        # flat grid (cpkv.kernels.grid.sparse_mla_grid): head blocks fastest, any number of tokens
        n_hb = tl.cdiv(H, BLOCK_H)
        pid_h = tl.program_id(0) % n_hb
        t = (tl.program_id(0) // n_hb).to(tl.int64)
        offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_v = tl.arange(0, D_V)
        q_rows = Q + t * stride_qt + offs_h[:, None] * stride_qh
        q_n = tl.load(q_rows + offs_v[None, :], mask=hmask[:, None], other=0.0)
        if D_R > 0:
            offs_r = tl.arange(0, D_R)
            q_r = tl.load(q_rows + D_V + offs_r[None, :], mask=hmask[:, None], other=0.0)
        if DENSE:
            start = tl.load(KS + t)
            n_keys = tl.maximum(tl.load(KE + t) - start, 0)
        else:
            start = 0
            n_keys = TOPK
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D_V], tl.float32)
        idx_row = IDX + t * stride_it
        for k0 in range(0, n_keys, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            if DENSE:
                idx = start + offs_k
                valid = (offs_k < n_keys) & (idx >= 0) & (idx < S)
            else:
                idx = tl.load(idx_row + offs_k, mask=offs_k < n_keys, other=-1)
                valid = (idx >= 0) & (idx < S)
            rows = KV + tl.where(valid, idx, 0).to(tl.int64)[:, None] * stride_kv
            k_n = tl.load(rows + offs_v[None, :], mask=valid[:, None], other=0.0)
            s = tl.dot(q_n, tl.trans(k_n))
            if D_R > 0:
                k_r = tl.load(rows + D_V + offs_r[None, :], mask=valid[:, None], other=0.0)
                s = tl.dot(q_r, tl.trans(k_r), s)
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(tl.bfloat16), k_n, acc * alpha[:, None])
            m_i = m_new
        empty = l_i == 0.0
        out = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse = tl.where(empty, float("inf"), (m_i + tl.log2(tl.where(empty, 1.0, l_i))) / 1.4426950408889634)
        o_rows = OUT + t * stride_ot + offs_h[:, None] * stride_oh
        tl.store(o_rows + offs_v[None, :], out.to(tl.bfloat16), mask=hmask[:, None])
        tl.store(LSE + t * stride_lt + offs_h, lse, mask=hmask)

    return _sparse_mla_fwd


def launch(
    q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor | None, ks: torch.Tensor | None,
    ke: torch.Tensor | None, sm_scale: float, d_v: int, config: Config | None = None,
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Run the kernel (inputs already validated, last dims contiguous). Returns (out, lse, compiled)."""
    t, h, d_qk = q.shape
    d_r = d_qk - d_v
    cfg = config or default_config(h, d_v, d_r, capability(q))
    out = torch.empty((t, h, d_v), dtype=torch.bfloat16, device=q.device)
    lse = torch.empty((t, h), dtype=torch.float32, device=q.device)
    if t == 0:
        return out, lse, None
    dense = indices is None
    idx = ks if dense else indices
    topk = 0 if dense else indices.shape[1]
    if cfg.impl == "gluon_ws":
        from cpkv.kernels.sparse_mla import gluon_ws as sparse_mla_ws

        return out, lse, sparse_mla_ws.launch(q, kv, indices, ks, ke, sm_scale, out, lse)
    grid = sparse_mla_grid(t, h, cfg.block_h)
    compiled = load()[grid](
        q, kv, idx, ks if dense else idx, ke if dense else idx, out, lse,
        kv.shape[0], h, topk, sm_scale * LOG2E,
        q.stride(0), q.stride(1), kv.stride(0), 0 if dense else indices.stride(0),
        out.stride(0), out.stride(1), lse.stride(0),
        D_V=d_v, D_R=d_r, BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, DENSE=dense,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return out, lse, compiled

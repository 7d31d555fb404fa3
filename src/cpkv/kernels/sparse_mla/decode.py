"""Triton sparse decode MLA over paged fp8 token rows, read in place (reference: ``ref.sparse_decode_mla_ref``).

    q      [B, H, D_L + D_R]  bfloat16   one query token per generation (GLM-5: H 64, 512 + 64; V3.2: H 128)
    bases  [cp]               int64      byte address of row 0 of each rank's token pool of this layer (peers'
                                         pools mapped into this process through CUDA IPC: any address is read)
    owner  [B, K]             int32/64   the rank holding selected key j of generation b
    row    [B, K]             int32/64   its row in that pool; < 0: no key
    out    [B, H, D_L]        bfloat16   the values are the dequantised latent dims (d_v = D_L)
    lse    [B, H]             float32    natural log of the scaled scores' sum; +inf (and out 0) with no key

Token row (``cpkv.config.RowFormat``; GLM-5 656 B): D_L fp8 e4m3 | G = D_L / 128 float32 scales | D_R bf16 rope.
A key is ``bf16(fp32(fp8) * scale) | rope``, as ``dequant_token_kv_ref`` makes it, dequantised in registers.

Split-K ("flash decoding"). Kernel 1 runs B x splits x head blocks programs; a program takes up to 64 heads of one
generation over a contiguous slice of its K keys, BLOCK_K keys a tile: loads each key's (owner, row), its address
``bases[owner] + row * row_bytes``, the tile's fp8 values, scales and rope, dequantises, scores all heads with one
[heads, D_L + D_R] x [D_L + D_R, BLOCK_K] bf16 dot (fp32 accumulate), runs the online softmax (base 2) and
accumulates P V (P in bf16, V the tile's D_L latent dims). It writes its slice's (o, lse) to a float32 workspace;
kernel 2, one program per (generation, head), combines the splits by lse. With one split kernel 1 writes the
result itself. ``splits`` comes from the shapes only (B x head blocks x splits about the SM count, no more splits
than key tiles), and a masked key is read on the device from ``row < 0``: no host sync, graph-capturable.

Addresses: every pointer is an offset from ``bases``' own storage (typed views of it: fp8, float32, bf16), as
``page_gather`` does, so the same code runs under Triton's interpreter on CPU tensors. Every base must be a
multiple of 4 bytes (the scales are read as float32); row offsets are known multiples of 16 bytes when the rows and
every base are (``aligned16``), so the 512 fp8 values load as 16-byte vectors. A masked key's owner is never read,
and a row >= 0 must lie in its pool (the kernel knows no pool's size). Triton is imported lazily by :func:`load`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from cpkv.config import QUANT_GROUP, RowFormat
from cpkv.kernels.grid import cdiv, flat_grid

LOG2E = 1.4426950408889634
INTERPRETER_SMS = 8  # the "SM count" splits are chosen for off CUDA (Triton's interpreter)
COMBINE_BLOCK = 16  # slices a combine program loads at once ([16, D_L] float32: 64 registers a thread at 4 warps)


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape: heads per program, keys per tile, warps, pipelining depth; ``splits`` None: from the shapes
    (:func:`plan_splits`); ``scale_gather``: load each value's scale by address ([BLOCK_K, D_L]) instead of
    one per group broadcast through a [BLOCK_K, G, 128] -> [BLOCK_K, D_L] reshape."""

    block_h: int = 64
    block_k: int = 64
    num_warps: int = 8
    num_stages: int = 2
    splits: int | None = None
    scale_gather: bool = False

    def tag(self) -> str:
        """Short name for tables: ``h64 k64 w8 s2 auto``."""
        extra = " gather" if self.scale_gather else ""
        return f"h{self.block_h} k{self.block_k} w{self.num_warps} s{self.num_stages} " \
               f"{self.splits or 'auto'}{extra}"


def default_config(h: int) -> DecodeConfig:
    """Heads per program: all of them up to 64 (a power of two, at least 16: ``tl.dot``'s least M)."""
    block_h = min(64, max(16, 1 << max(0, (h - 1).bit_length())))
    return DecodeConfig(block_h=block_h, num_warps=8 if block_h == 64 else 4)


def supported(fmt: RowFormat, d_v: int) -> bool:
    """Whether the kernel takes this row format: d_v = D_L = 128 G, G and D_R powers of two (``tl.arange``), D_R 0
    or >= 16 (``tl.dot``), rows of whole 4-byte words (the scales are read as float32)."""
    if not isinstance(fmt, RowFormat):
        return False
    g, d_r = fmt.scale_count, fmt.rope_dims
    return (fmt.fp8_bytes == QUANT_GROUP * g == d_v and g >= 1 and g & (g - 1) == 0
            and (d_r == 0 or (d_r >= 16 and d_r & (d_r - 1) == 0)) and fmt.row_bytes % 4 == 0)


def plan_splits(b: int, head_blocks: int, k: int, block_k: int, sms: int) -> tuple[int, int]:
    """(splits, keys per split): about ``sms`` programs of B x head blocks x splits, a split at least one key tile
    and a whole number of them; the last split may be shorter. B = 1, K = 2048, 64-key tiles: 32 splits of 64 keys
    (32 of 132 SMs); B = 8: 16 of 128; B = 32: 5 of 448.

    Why B = 1 does not take every SM through smaller slices: a program's fixed traffic, q in (64 heads x 576 bf16,
    74 KB) and its partial o out (64 x 512 float32, 131 KB, read again by the combine), outweighs its share of
    rows (64 keys: 42 KB), so 128 slices of 16 keys would move 4x the partials to save a fifth of each program's
    bytes. ``cpkv bench attention --decode --sweep`` times 16- and 32-key tiles and fixed split counts against it."""
    tiles = cdiv(max(k, 1), block_k)
    want = max(1, min(tiles, cdiv(sms, max(b * head_blocks, 1))))
    per_split = cdiv(tiles, want) * block_k
    return cdiv(max(k, 1), per_split), per_split


@lru_cache(maxsize=1)
def load() -> tuple[Any, Any]:
    """(split kernel, combine kernel), compiled on demand."""
    import triton
    import triton.language as tl

    @triton.jit
    def _decode_split(
        Q, BASES, AF8, AF32, AB16, anchor, OWNER, ROW, WO, WL, OUT, LSE,
        H, K, per_split, splits, n_hb, scale_log2,
        stride_qb, stride_qh, stride_ownb, stride_rowb, stride_wb, stride_ws, stride_wh, stride_lb, stride_ls,
        stride_ob, stride_oh, stride_lseb,
        G: tl.constexpr, D_R: tl.constexpr, ROW_BYTES: tl.constexpr, ALIGN16: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_GATHER: tl.constexpr, DIRECT: tl.constexpr,
    ):
        D_L: tl.constexpr = G * 128
        SCALE_W: tl.constexpr = D_L // 4  # the scales' offset in a row, in float32 words
        ROPE_H: tl.constexpr = (D_L + 4 * G) // 2  # the rope's offset in a row, in bf16 halves
        pid = tl.program_id(0)
        hb = pid % n_hb
        s = (pid // n_hb) % splits
        b = (pid // (n_hb * splits)).to(tl.int64)
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_l = tl.arange(0, D_L)
        q_rows = Q + b * stride_qb + offs_h[:, None] * stride_qh
        q_n = tl.load(q_rows + offs_l[None, :], mask=hmask[:, None], other=0.0)
        if D_R > 0:
            offs_r = tl.arange(0, D_R)
            q_r = tl.load(q_rows + D_L + offs_r[None, :], mask=hmask[:, None], other=0.0)
        offs_g = tl.arange(0, G)
        lat = offs_g[:, None] * 128 + tl.arange(0, 128)[None, :]  # [G, 128]: group g's dims
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, D_L], tl.float32)
        k_lo = s * per_split
        k_hi = tl.minimum(k_lo + per_split, K)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            r = tl.load(ROW + b * stride_rowb + offs_k, mask=offs_k < k_hi, other=-1).to(tl.int64)
            valid = r >= 0
            own = tl.load(OWNER + b * stride_ownb + offs_k, mask=valid, other=0)
            base = tl.load(BASES + own, mask=valid, other=anchor)
            d = tl.where(valid, base + r * ROW_BYTES - anchor, 0)  # the row's byte offset from ``bases``
            if ALIGN16:  # in 16-byte units: the compiler then knows every field's alignment
                u = d // 16
                d8, d32, d16 = u * 16, u * 4 + SCALE_W, u * 8 + ROPE_H
            else:
                d8, d32, d16 = d, d // 4 + SCALE_W, d // 2 + ROPE_H
            if SCALE_GATHER:
                x = tl.load(AF8 + d8[:, None] + offs_l[None, :], mask=valid[:, None], other=0.0)
                sc = tl.load(AF32 + d32[:, None] + (offs_l // 128)[None, :], mask=valid[:, None], other=0.0)
                k_n = (x.to(tl.float32) * sc).to(tl.bfloat16)
            else:
                x = tl.load(AF8 + d8[:, None, None] + lat[None, :, :], mask=valid[:, None, None], other=0.0)
                sc = tl.load(AF32 + d32[:, None] + offs_g[None, :], mask=valid[:, None], other=0.0)
                k_n = tl.reshape((x.to(tl.float32) * sc[:, :, None]).to(tl.bfloat16), [BLOCK_K, D_L])
            qk = tl.dot(q_n, tl.trans(k_n))
            if D_R > 0:
                k_r = tl.load(AB16 + d16[:, None] + offs_r[None, :], mask=valid[:, None], other=0.0)
                qk = tl.dot(q_r, tl.trans(k_r), qk)
            qk = tl.where(valid[None, :], qk * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(qk - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(tl.bfloat16), k_n, acc * alpha[:, None])
            m_i = m_new
        empty = l_i == 0.0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse2 = m_i + tl.log2(tl.where(empty, 1.0, l_i))  # base 2; -inf for a slice with no key
        if DIRECT:
            o_rows = OUT + b * stride_ob + offs_h[:, None] * stride_oh
            tl.store(o_rows + offs_l[None, :], o.to(tl.bfloat16), mask=hmask[:, None])
            tl.store(LSE + b * stride_lseb + offs_h, tl.where(empty, float("inf"), lse2 / 1.4426950408889634),
                     mask=hmask)
        else:
            w_rows = WO + b * stride_wb + s * stride_ws + offs_h[:, None] * stride_wh
            tl.store(w_rows + offs_l[None, :], o, mask=hmask[:, None])
            tl.store(WL + b * stride_lb + s * stride_ls + offs_h, tl.where(empty, float("-inf"), lse2), mask=hmask)

    @triton.jit
    def _decode_combine(
        WO, WL, OUT, LSE, H, splits,
        stride_wb, stride_ws, stride_wh, stride_lb, stride_ls, stride_ob, stride_oh, stride_lseb,
        D_L: tl.constexpr, SPLITS: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
    ):
        # one program per (generation, head): the slices' o weighted by 2^(lse_s - max lse), SPLIT_BLOCK slices'
        # rows a load (all in flight at once, not one latency per slice)
        pid = tl.program_id(0)
        h = pid % H
        b = (pid // H).to(tl.int64)
        l_row = WL + b * stride_lb + h
        offs_s = tl.arange(0, SPLITS)
        lse_s = tl.load(l_row + offs_s * stride_ls, mask=offs_s < splits, other=float("-inf"))
        m = tl.max(lse_s, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp2(lse_s - m_safe), 0)
        offs_l = tl.arange(0, D_L)
        acc = tl.zeros([D_L], tl.float32)
        w_rows = WO + b * stride_wb + h * stride_wh + offs_l[None, :]
        for s0 in range(0, splits, SPLIT_BLOCK):
            offs = s0 + tl.arange(0, SPLIT_BLOCK)
            smask = offs < splits
            w = tl.exp2(tl.load(l_row + offs * stride_ls, mask=smask, other=float("-inf")) - m_safe)
            o_s = tl.load(w_rows + offs[:, None] * stride_ws, mask=smask[:, None], other=0.0)
            acc += tl.sum(w[:, None] * o_s, 0)
        empty = total == 0.0
        o = acc / tl.where(empty, 1.0, total)
        tl.store(OUT + b * stride_ob + h * stride_oh + offs_l, o.to(tl.bfloat16))
        lse = tl.where(empty, float("inf"), (m_safe + tl.log2(tl.where(empty, 1.0, total))) / 1.4426950408889634)
        tl.store(LSE + b * stride_lseb + h, lse)

    return _decode_split, _decode_combine


def sparse_decode_mla(
    q: torch.Tensor, bases: torch.Tensor, owner: torch.Tensor, row: torch.Tensor, sm_scale: float, d_v: int,
    fmt: RowFormat, out: torch.Tensor | None = None, *, aligned16: bool = True, config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring (inputs validated by ``cpkv.attention.sparse_decode``; q's and out's last dims
    contiguous). ``aligned16``: every base is a multiple of 16 (true of torch's allocations and of a pool's layer
    slots; rows of 656 bytes keep it). ``out``: bf16 [B, H, d_v] written in place. Returns (out, lse)."""
    b, h, _ = q.shape
    k = row.shape[1]
    out = torch.empty((b, h, d_v), dtype=torch.bfloat16, device=q.device) if out is None else out
    lse = torch.empty((b, h), dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    cfg = config or default_config(h)
    n_hb = cdiv(h, cfg.block_h)
    sms = sm_count_of(q)
    splits, per_split = plan_splits(b, n_hb, k, cfg.block_k, sms) if cfg.splits is None else \
        _fixed_splits(cfg.splits, k, cfg.block_k)
    direct = splits == 1
    wo = torch.empty((1, 1, 1, 1) if direct else (b, splits, h, d_v), dtype=torch.float32, device=q.device)
    wl = torch.empty((1, 1, 1) if direct else (b, splits, h), dtype=torch.float32, device=q.device)
    anchor = bases.data_ptr()
    align = aligned16 and fmt.row_bytes % 16 == 0 and anchor % 16 == 0
    split_kernel, combine_kernel = load()
    split_kernel[flat_grid(n_hb * splits, b)](
        q, bases, bases.view(torch.float8_e4m3fn), bases.view(torch.float32), bases.view(torch.bfloat16), anchor,
        owner, row, wo, wl, out, lse,
        h, k, per_split, splits, n_hb, float(sm_scale) * LOG2E,
        q.stride(0), q.stride(1), owner.stride(0), row.stride(0), wo.stride(0), wo.stride(1), wo.stride(2),
        wl.stride(0), wl.stride(1), out.stride(0), out.stride(1), lse.stride(0),
        G=fmt.scale_count, D_R=fmt.rope_dims, ROW_BYTES=fmt.row_bytes, ALIGN16=align,
        BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, SCALE_GATHER=cfg.scale_gather, DIRECT=direct,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    if not direct:
        combine_kernel[flat_grid(h, b)](
            wo, wl, out, lse, h, splits,
            wo.stride(0), wo.stride(1), wo.stride(2), wl.stride(0), wl.stride(1), out.stride(0), out.stride(1),
            lse.stride(0), D_L=d_v, SPLITS=max(2, 1 << (splits - 1).bit_length()), SPLIT_BLOCK=COMBINE_BLOCK,
            num_warps=4,
        )
    return out, lse


def _fixed_splits(splits: int, k: int, block_k: int) -> tuple[int, int]:
    """(splits, keys per split) for a chosen count: ``splits`` slices of whole tiles (fewer if K has fewer tiles)."""
    per_split = cdiv(cdiv(max(k, 1), block_k), max(1, splits)) * block_k
    return cdiv(max(k, 1), per_split), per_split


def sm_count_of(q: torch.Tensor) -> int:
    """The SM count splits are planned for: the device's (``platform.sm_count``), INTERPRETER_SMS off CUDA."""
    if not q.is_cuda:
        return INTERPRETER_SMS
    from cpkv.kernels.platform import sm_count

    return sm_count(q)

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

Split-K ("flash decoding"). Kernel 1 runs B x splits x head blocks x value blocks programs; a program takes
BLOCK_H heads of one generation over a contiguous slice of its K keys, BLOCK_K keys a tile: loads each key's
(owner, row), its address ``bases[owner] + row * row_bytes``, the tile's fp8 values, scales and rope, dequantises,
scores its heads with one [heads, D_L + D_R] x [D_L + D_R, BLOCK_K] bf16 dot (fp32 accumulate), runs the online
softmax (base 2) and accumulates P V over its BLOCK_V value dims (P in bf16). It writes its slice's (o, lse) to a
float32 workspace; kernel 2, one program per (generation, head, value dims), combines the splits by lse. With one
split kernel 1 writes the result itself.

Launch shape (:data:`DEFAULTS`, chosen from (H, B) only: no host sync, graph-capturable, any B). A tile is little
work (32 keys x 64 heads: 4.5 MFLOP, well under a microsecond of one SM's tensor cores, and 21 KB of rows) behind
a chain of dependent loads: the indices, then the rows at the addresses they give. Left in the loop body, the
chain costs a few DRAM round trips per tile and the SM idles through them. So:

  * the row and owner load together and the base is picked among the cp bases held in registers (no gather by
    owner: one round trip a tile instead of three before the rows);
  * ``num_stages`` 5 gives each link two pipeline stages: indices and rows land in double-buffered shared memory
    by cp.async, the indices two tiles ahead of their use, the rows one, so tile t + 1's rows are in flight
    while tile t is dequantised and multiplied;
  * a program holds 64 heads and all 512 value dims, so nothing is read, dequantised or multiplied twice: the
    dots are Hopper wgmma (M = 64) with q resident in shared memory, the [64, 512] fp32 accumulator 128 registers
    a thread at 8 warps; 32-key tiles keep it at 150 KB of shared memory and 255 registers without a spill,
    one program an SM (64-key tiles, double-buffered, would ask 229 KB). 17 to 63 heads pad the one 64-head
    block.

Value blocks (``block_v``: each re-reads and re-dequantises its rows and recomputes the scores) and smaller head
blocks (``block_h`` 16 / 32: mma.sync, whose 512-dim operands sit in registers: 168 to 255 a thread; each block
re-reads and re-dequantises the rows) buy occupancy by duplicating work; both stay in ``cpkv bench attention
--decode --sweep``. Up to 16 heads (the tiny models) take 16-head blocks of 16-key tiles (168 registers, 40 KB:
several programs an SM, planned for two).

Splits (:func:`plan_splits`): B x head blocks x value blocks x splits at most ``per_sm`` programs an SM (a second,
partial wave would cost as much as the first), each split at least 64 keys: a program's partial o (64 x 512
float32, 128 KB, written and then read by the combine) is three times a 64-key slice's rows, so finer splits
move more partials than rows. At B = 1 and 64 heads: 32 programs of two tiles. A masked key is read on the device
from ``row < 0``.

Addresses: every pointer is an offset from ``bases``' own storage (typed views of it: fp8, float32, bf16), as
``page_gather`` does, so the same code runs under Triton's interpreter on CPU tensors. Every base must be a
multiple of 4 bytes (the scales are read as float32); row offsets are known multiples of 16 bytes when the rows and
every base are (``aligned16``), so the 512 fp8 values load as 16-byte vectors. A masked key's owner is loaded but
never used, and a row >= 0 must lie in its pool and its owner in [0, cp) (the kernel checks neither). Triton is
imported lazily by :func:`load`.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import torch

from cpkv.config import QUANT_GROUP, RowFormat
from cpkv.errors import AttentionError
from cpkv.kernels.grid import cdiv, flat_grid

LOG2E = 1.4426950408889634
INTERPRETER_SMS = 8  # the "SM count" splits are chosen for off CUDA (Triton's interpreter)
MAX_SELECT = 8  # up to this many pools a key's base is picked in registers; more: gathered (one more link)
MIN_SPLIT_KEYS = 64  # a split's least keys (module docstring)
COMBINE_ELEMS = 16 * 512  # float32 a combine program loads at once (64 registers a thread at 4 warps)
ANY_B = 1 << 31


@dataclass(frozen=True)
class DecodeConfig:
    """Launch shape (the defaults: the 64-head row of :data:`DEFAULTS`): heads per program, keys per tile, warps,
    pipelining depth; ``splits`` None: from the shapes (:func:`plan_splits`, at most ``per_sm`` programs an SM);
    ``scale_gather``: load each value's scale by address ([BLOCK_K, D_L]) instead of one per group broadcast
    through a [BLOCK_K, G, 128] -> [BLOCK_K, D_L] reshape; ``block_v``: value dims per program (a power-of-two
    multiple of 128 dividing D_L; 0: all of them); ``chained``: the owner loaded only once its row is known valid
    and the base gathered by it (two more dependent round trips a tile: the first kernel's chain, for the sweep's
    comparison); ``combine_d``: value dims per combine program (0: from the shapes, :func:`combine_block`)."""

    block_h: int = 64
    block_k: int = 32
    num_warps: int = 8
    num_stages: int = 5
    splits: int | None = None
    scale_gather: bool = False
    block_v: int = 0
    per_sm: int = 1
    chained: bool = False
    combine_d: int = 0

    def tag(self) -> str:
        """Short name for tables: ``h64 k32 w8 s5 auto`` (``v256``: value dims a program; ``auto x2``: splits
        planned for two programs an SM; ``c512``: the combine's value dims a program)."""
        v = f" v{self.block_v}" if self.block_v else ""
        planned = self.splits or ("auto" if self.per_sm == 1 else f"auto x{self.per_sm}")
        extra = (" gather" if self.scale_gather else "") + (" chained" if self.chained else "") + \
            (f" c{self.combine_d}" if self.combine_d else "")
        return f"h{self.block_h}{v} k{self.block_k} w{self.num_warps} s{self.num_stages} {planned}{extra}"


# (least heads, most generations, config): the first row that takes (H, B) is the default (module docstring)
DEFAULTS: tuple[tuple[int, int, DecodeConfig], ...] = (
    (17, ANY_B, DecodeConfig()),
    (1, ANY_B, DecodeConfig(block_h=16, block_k=16, num_warps=4, num_stages=5, per_sm=2)),
)


def default_config(h: int, b: int) -> DecodeConfig:
    """The launch shape for H heads and B generations: the first row of :data:`DEFAULTS` that takes them."""
    return next(cfg for least_h, most_b, cfg in DEFAULTS if h >= least_h and b <= most_b)


def supported(fmt: RowFormat, d_v: int) -> bool:
    """Whether the kernel takes this row format: d_v = D_L = 128 G, G and D_R powers of two (``tl.arange``), D_R 0
    or >= 16 (``tl.dot``), rows of whole 4-byte words (the scales are read as float32)."""
    if not isinstance(fmt, RowFormat):
        return False
    g, d_r = fmt.scale_count, fmt.rope_dims
    return (fmt.fp8_bytes == QUANT_GROUP * g == d_v and g >= 1 and g & (g - 1) == 0
            and (d_r == 0 or (d_r >= 16 and d_r & (d_r - 1) == 0)) and fmt.row_bytes % 4 == 0)


def plan_splits(b: int, blocks: int, k: int, block_k: int, slots: int) -> tuple[int, int]:
    """(splits, keys per split): B x ``blocks`` (head x value blocks) x splits at most ``slots`` programs (at least
    one split), a split a whole number of key tiles and at least MIN_SPLIT_KEYS keys where K has them; the last
    split may be shorter. 64 heads, K = 2048, 32-key tiles, 132 slots: B = 1: 32 splits of 64 keys; B = 8: 16 of
    128; B = 32: 4 of 512 (128 programs)."""
    tiles = cdiv(max(k, 1), block_k)
    most = max(1, tiles // cdiv(MIN_SPLIT_KEYS, block_k))
    want = max(1, min(most, slots // max(b * blocks, 1)))
    per_split = cdiv(tiles, want) * block_k
    return cdiv(max(k, 1), per_split), per_split


def combine_block(b: int, h: int, d_v: int, sms: int) -> int:
    """Value dims a combine program takes: halved from d_v down to 128 while B x H x (d_v / dims) is under four
    programs an SM (B = 1, 64 heads: 128 dims, 256 programs; B = 32: 512, 2,048 programs)."""
    d = d_v
    while d > 128 and d % 256 == 0 and b * h * (d_v // d) < 4 * sms:
        d //= 2
    return d


@lru_cache(maxsize=1)
def load() -> tuple[Any, Any]:
    """(split kernel, combine kernel), compiled on demand."""
    import triton
    import triton.language as tl

    @triton.jit
    def _key_offsets(BASES, OWNER, ROW, k0, k_hi, anchor, ROW_BYTES: tl.constexpr, BLOCK_K: tl.constexpr,
                     CP: tl.constexpr, CHAINED: tl.constexpr):
        # keys k0 .. k0 + BLOCK_K of one generation: (their rows' byte offsets from ``bases``, 0 where masked; mask).
        # The owner loads beside the row (CHAINED: only for a valid row, a round trip later); the base is picked
        # among the CP bases (CP 0: gathered by the owner, another round trip)
        offs_k = k0 + tl.arange(0, BLOCK_K)
        inside = offs_k < k_hi
        r = tl.load(ROW + offs_k, mask=inside, other=-1).to(tl.int64)
        valid = r >= 0
        own = tl.load(OWNER + offs_k, mask=valid if CHAINED else inside, other=0)
        if CP > 0:
            base = tl.zeros([BLOCK_K], tl.int64) + anchor
            for c in tl.static_range(CP):
                base = tl.where(own == c, tl.load(BASES + c), base)
        else:
            base = tl.load(BASES + own, mask=valid, other=anchor)
        return tl.where(valid, base + r * ROW_BYTES - anchor, 0), valid

    @triton.jit
    def _dequant(AF8, AF32, d8, d32, valid, g0, NG: tl.constexpr, BLOCK_K: tl.constexpr,
                 SCALE_GATHER: tl.constexpr):
        # [BLOCK_K, NG * 128] bf16: latent groups g0 .. g0 + NG of the keys, bf16(fp32(fp8) * scale)
        if SCALE_GATHER:
            offs = g0 * 128 + tl.arange(0, NG * 128)
            x = tl.load(AF8 + d8[:, None] + offs[None, :], mask=valid[:, None], other=0.0)
            sc = tl.load(AF32 + d32[:, None] + (offs // 128)[None, :], mask=valid[:, None], other=0.0)
            k = (x.to(tl.float32) * sc).to(tl.bfloat16)
        else:
            offs_g = tl.arange(0, NG)
            lat = (g0 + offs_g[:, None]) * 128 + tl.arange(0, 128)[None, :]  # [NG, 128]: group g's dims
            x = tl.load(AF8 + d8[:, None, None] + lat[None, :, :], mask=valid[:, None, None], other=0.0)
            sc = tl.load(AF32 + d32[:, None] + g0 + offs_g[None, :], mask=valid[:, None], other=0.0)
            k = tl.reshape((x.to(tl.float32) * sc[:, :, None]).to(tl.bfloat16), [BLOCK_K, NG * 128])
        return k

    # the kernel finds its helpers as module globals (also in TRITON_INTERPRET), as page_gather's do
    globals()["_key_offsets"] = _key_offsets
    globals()["_dequant"] = _dequant

    @triton.jit
    def _decode_split(
        Q, BASES, AF8, AF32, AB16, anchor, OWNER, ROW, WO, WL, OUT, LSE,
        H, K, per_split, splits, n_hb, scale_log2,
        stride_qb, stride_qh, stride_ownb, stride_rowb, stride_wb, stride_ws, stride_wh, stride_lb, stride_ls,
        stride_ob, stride_oh, stride_lseb,
        G: tl.constexpr, D_R: tl.constexpr, ROW_BYTES: tl.constexpr, ALIGN16: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, SCALE_GATHER: tl.constexpr,
        CP: tl.constexpr, CHAINED: tl.constexpr, DIRECT: tl.constexpr,
    ):
        D_L: tl.constexpr = G * 128
        GV: tl.constexpr = BLOCK_V // 128  # latent groups per value block
        NV: tl.constexpr = D_L // BLOCK_V  # value blocks
        SCALE_W: tl.constexpr = D_L // 4  # the scales' offset in a row, in float32 words
        ROPE_H: tl.constexpr = (D_L + 4 * G) // 2  # the rope's offset in a row, in bf16 halves
        pid = tl.program_id(0)  # value blocks fastest, then head blocks, splits, generations
        vb = pid % NV
        hb = (pid // NV) % n_hb
        s = (pid // (NV * n_hb)) % splits
        b = (pid // (NV * n_hb * splits)).to(tl.int64)
        k_lo = s * per_split
        k_hi = tl.minimum(k_lo + per_split, K)
        OWNER += b * stride_ownb
        ROW += b * stride_rowb
        offs_h = hb * BLOCK_H + tl.arange(0, BLOCK_H)
        hmask = offs_h < H
        offs_l = tl.arange(0, D_L)
        q_rows = Q + b * stride_qb + offs_h[:, None] * stride_qh
        q_n = tl.load(q_rows + offs_l[None, :], mask=hmask[:, None], other=0.0)
        if D_R > 0:
            offs_r = tl.arange(0, D_R)
            q_r = tl.load(q_rows + D_L + offs_r[None, :], mask=hmask[:, None], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_H], tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_V], tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            d, valid = _key_offsets(BASES, OWNER, ROW, k0, k_hi, anchor, ROW_BYTES, BLOCK_K, CP, CHAINED)
            if ALIGN16:  # in 16-byte units: the compiler then knows every field's alignment
                u = d // 16
                d8, d32, d16 = u * 16, u * 4 + SCALE_W, u * 8 + ROPE_H
            else:
                d8, d32, d16 = d, d // 4 + SCALE_W, d // 2 + ROPE_H
            k_n = _dequant(AF8, AF32, d8, d32, valid, 0, G, BLOCK_K, SCALE_GATHER)
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
            if NV == 1:
                v = k_n
            else:  # this program's value dims, read again (the rows are in L2 / L1) and dequantised alike
                v = _dequant(AF8, AF32, d8, d32, valid, vb * GV, GV, BLOCK_K, SCALE_GATHER)
            acc = tl.dot(p.to(tl.bfloat16), v, acc * alpha[:, None])
            m_i = m_new
        empty = l_i == 0.0
        o = acc / tl.where(empty, 1.0, l_i)[:, None]
        lse2 = m_i + tl.log2(tl.where(empty, 1.0, l_i))  # base 2; -inf for a slice with no key
        offs_v = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        lmask = hmask & (vb == 0)  # every value block finds the same lse: the first writes it
        if DIRECT:
            o_rows = OUT + b * stride_ob + offs_h[:, None] * stride_oh
            tl.store(o_rows + offs_v[None, :], o.to(tl.bfloat16), mask=hmask[:, None])
            tl.store(LSE + b * stride_lseb + offs_h, tl.where(empty, float("inf"), lse2 / 1.4426950408889634),
                     mask=lmask)
        else:
            w_rows = WO + b * stride_wb + s * stride_ws + offs_h[:, None] * stride_wh
            tl.store(w_rows + offs_v[None, :], o, mask=hmask[:, None])
            tl.store(WL + b * stride_lb + s * stride_ls + offs_h, tl.where(empty, float("-inf"), lse2), mask=lmask)

    @triton.jit
    def _decode_combine(
        WO, WL, OUT, LSE, H, splits,
        stride_wb, stride_ws, stride_wh, stride_lb, stride_ls, stride_ob, stride_oh, stride_lseb,
        D_L: tl.constexpr, BLOCK_D: tl.constexpr, SPLITS: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
    ):
        # one program per (generation, head, BLOCK_D value dims): the slices' o weighted by 2^(lse_s - max lse),
        # SPLIT_BLOCK slices' rows a load (all in flight at once, not one latency per slice)
        ND: tl.constexpr = D_L // BLOCK_D
        pid = tl.program_id(0)
        db = pid % ND
        h = (pid // ND) % H
        b = (pid // (ND * H)).to(tl.int64)
        l_row = WL + b * stride_lb + h
        offs_s = tl.arange(0, SPLITS)
        lse_s = tl.load(l_row + offs_s * stride_ls, mask=offs_s < splits, other=float("-inf"))
        m = tl.max(lse_s, 0)
        m_safe = tl.where(m == float("-inf"), 0.0, m)
        total = tl.sum(tl.exp2(lse_s - m_safe), 0)
        offs_d = db * BLOCK_D + tl.arange(0, BLOCK_D)
        acc = tl.zeros([BLOCK_D], tl.float32)
        w_rows = WO + b * stride_wb + h * stride_wh + offs_d[None, :]
        for s0 in range(0, splits, SPLIT_BLOCK):
            offs = s0 + tl.arange(0, SPLIT_BLOCK)
            smask = offs < splits
            w = tl.exp2(tl.load(l_row + offs * stride_ls, mask=smask, other=float("-inf")) - m_safe)
            o_s = tl.load(w_rows + offs[:, None] * stride_ws, mask=smask[:, None], other=0.0)
            acc += tl.sum(w[:, None] * o_s, 0)
        empty = total == 0.0
        o = acc / tl.where(empty, 1.0, total)
        tl.store(OUT + b * stride_ob + h * stride_oh + offs_d, o.to(tl.bfloat16))
        lse = tl.where(empty, float("inf"), (m_safe + tl.log2(tl.where(empty, 1.0, total))) / 1.4426950408889634)
        tl.store(LSE + b * stride_lseb + h, lse, mask=db == 0)

    return _decode_split, _decode_combine


def sparse_decode_mla(
    q: torch.Tensor, bases: torch.Tensor, owner: torch.Tensor, row: torch.Tensor, sm_scale: float, d_v: int,
    fmt: RowFormat, out: torch.Tensor | None = None, *, aligned16: bool = True, config: DecodeConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """See the module docstring (inputs validated by ``cpkv.attention.sparse_decode``; q's and out's last dims
    contiguous). ``aligned16``: every base is a multiple of 16 (true of torch's allocations and of a pool's layer
    slots; rows of 656 bytes keep it). ``out``: bf16 [B, H, d_v] written in place. ``config``: None: the table's
    (:func:`default_config`); AttentionError for one the row format cannot take. Returns (out, lse)."""
    b, h, _ = q.shape
    out = torch.empty((b, h, d_v), dtype=torch.bfloat16, device=q.device) if out is None else out
    lse = torch.empty((b, h), dtype=torch.float32, device=q.device)
    if b == 0:
        return out, lse
    cfg = config or default_config(h, b)
    block_v = check_config(cfg, d_v)
    sms = sm_count_of(q)
    splits, per_split = split_plan(cfg, b, h, row.shape[1], d_v, sms)
    direct = splits == 1
    wo = torch.empty((1, 1, 1, 1) if direct else (b, splits, h, d_v), dtype=torch.float32, device=q.device)
    wl = torch.empty((1, 1, 1) if direct else (b, splits, h), dtype=torch.float32, device=q.device)
    align = aligned16 and fmt.row_bytes % 16 == 0 and bases.data_ptr() % 16 == 0
    split_kernel, combine_kernel = load()
    grid, args, consts = split_launch(q, bases, owner, row, wo, wl, out, lse, sm_scale, fmt, cfg, block_v,
                                      (splits, per_split), align)
    split_kernel[grid](*args, **consts)
    if not direct:
        block_d = cfg.combine_d or combine_block(b, h, d_v, sms)
        combine_kernel[flat_grid(h * (d_v // block_d), b)](
            wo, wl, out, lse, h, splits,
            wo.stride(0), wo.stride(1), wo.stride(2), wl.stride(0), wl.stride(1), out.stride(0), out.stride(1),
            lse.stride(0), D_L=d_v, BLOCK_D=block_d, SPLITS=_pow2(splits),
            SPLIT_BLOCK=min(_pow2(splits), COMBINE_ELEMS // block_d), num_warps=4,
        )
    return out, lse


def split_plan(cfg: DecodeConfig, b: int, h: int, k: int, d_v: int, sms: int) -> tuple[int, int]:
    """(splits, keys per split) of a launch: ``cfg.splits`` slices when fixed, else :func:`plan_splits` for
    ``sms`` x ``cfg.per_sm`` program slots."""
    if cfg.splits is not None:
        return _fixed_splits(cfg.splits, k, cfg.block_k)
    blocks = cdiv(h, cfg.block_h) * (d_v // (cfg.block_v or d_v))
    return plan_splits(b, blocks, k, cfg.block_k, sms * cfg.per_sm)


def split_launch(
    q: torch.Tensor, bases: torch.Tensor, owner: torch.Tensor, row: torch.Tensor, wo: torch.Tensor, wl: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, sm_scale: float, fmt: RowFormat, cfg: DecodeConfig, block_v: int,
    split: tuple[int, int], align: bool,
) -> tuple[tuple[int], tuple, dict[str, Any]]:
    """(grid, arguments, constexprs and launch options) of the split kernel; ``split``: (splits, keys per split).
    Apart so that tests compile exactly what a launch runs (offline, for sm_90a)."""
    (b, h, _), (splits, per_split) = q.shape, split
    n_hb, n_vb = cdiv(h, cfg.block_h), fmt.fp8_bytes // block_v
    cp = bases.shape[0]
    args = (q, bases, bases.view(torch.float8_e4m3fn), bases.view(torch.float32), bases.view(torch.bfloat16),
            bases.data_ptr(), owner, row, wo, wl, out, lse,
            h, row.shape[1], per_split, splits, n_hb, float(sm_scale) * LOG2E,
            q.stride(0), q.stride(1), owner.stride(0), row.stride(0), wo.stride(0), wo.stride(1), wo.stride(2),
            wl.stride(0), wl.stride(1), out.stride(0), out.stride(1), lse.stride(0))
    consts = dict(G=fmt.scale_count, D_R=fmt.rope_dims, ROW_BYTES=fmt.row_bytes, ALIGN16=align,
                  BLOCK_H=cfg.block_h, BLOCK_K=cfg.block_k, BLOCK_V=block_v, SCALE_GATHER=cfg.scale_gather,
                  CP=0 if cfg.chained or cp > MAX_SELECT else cp, CHAINED=cfg.chained, DIRECT=splits == 1,
                  num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    return flat_grid(n_vb * n_hb * splits, b), args, consts


def check_config(cfg: DecodeConfig, d_v: int) -> int:
    """The value dims a program takes (``cfg.block_v``, or all d_v); AttentionError when the config cannot run
    over d_v latent dims: head and key blocks powers of two >= 16 (``tl.dot``), value blocks (and the combine's)
    power-of-two multiples of 128 dividing d_v, ``per_sm`` and a fixed ``splits`` >= 1."""
    block_v = cfg.block_v or d_v
    ok = (_is_pow2(cfg.block_h) and cfg.block_h >= 16 and _is_pow2(cfg.block_k) and cfg.block_k >= 16
          and _divides_in_groups(block_v, d_v) and (cfg.combine_d == 0 or _divides_in_groups(cfg.combine_d, d_v))
          and cfg.per_sm >= 1 and (cfg.splits is None or cfg.splits >= 1))
    if not ok:
        raise AttentionError(f"sparse decode config {cfg.tag()}: expected block_h and block_k powers of two >= 16, "
                             f"block_v and combine_d 0 or a power-of-two multiple of 128 dividing d_v = {d_v}, "
                             f"per_sm and splits >= 1")
    return block_v


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def _divides_in_groups(n: int, d_v: int) -> bool:
    """n a power-of-two multiple of 128 dividing d_v."""
    return n % 128 == 0 and _is_pow2(n // 128) and d_v % n == 0


def _pow2(n: int) -> int:
    """The least power of two >= max(n, 2)."""
    return max(2, 1 << (n - 1).bit_length())


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

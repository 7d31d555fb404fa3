"""Triton kernels of the block-scaled fp8 GEMMs (reference: ``cpkv.kernels.fp8_gemm.ref``).

    act_quant(x [M, K] bf16/f32, q fp8 [M, K], s float32 (M, ceil(K/128)) any strides)
        per token per 1 x 128 group: s = amax / 448 (0 for a zero group), q = rne(x / s); the scale tensor's
        strides are the caller's (``torch._scaled_mm`` wants them outer-dim-major: strides (1, M))
    swiglu_quant(gu [M, 2I], rw float32 [M] | None, q fp8 [M, I], s float32 [M, ceil(I/128)])
        a = silu(g) * u (* rw), g = gu[:, :I], u = gu[:, I:], quantised as act_quant
    grouped_gemm(a fp8 [R, K], a_s float32 [R, ceil(K/128)] (any strides; the callers allocate them row-major),
                 offs int32 [E], b fp8 [E, N, K],
                 b_s float32 [E, ceil(N/128), ceil(K/128)] (unit stride along K), c bf16 [R, N])
        rows sorted by expert: row i of expert e (offs[e-1] <= i < offs[e]) gets
        c[i] = sum_g a_s[i, g] b_s[e, n // 128, g] (a[i, g] . b[e, n, g]) for every group g of 128 along K.
        Rows at or past offs[-1] are not written.

The grouped GEMM never reads the offsets on the host: it launches cdiv(R, BLOCK_M) + E row tiles of BLOCK_M
rows (each expert adds at most one partial tile) times cdiv(N, BLOCK_N) column tiles (or one program per SM
looping over them); ``tile_ends`` (three small torch ops on the device) counts each expert's tiles cumulatively,
a program finds its expert by a binary search over those counts (or reductions over them held in registers),
and a program past the last expert's tiles returns. Any R (0 included), any expert loads (empty experts
included), any K and N (loads at clamped indices, stores masked). A few variants of it (``VARIANTS``);
``GROUPED`` selects the one the model runs. The GLUON variants run the warp-specialised Gluon kernel of
``gluon_ws.py`` instead (Hopper, N and K multiples of 128: a TMA producer warp and two consumer warpgroups, so
one warpgroup's per-K-block scaling overlaps the other's wgmma; elsewhere they run ``GLUON_FALLBACK``, the
fastest Triton variant). The dispatch points import this module once their Backends say Triton runs; without
Triton it still imports (its kernels raise ImportError when launched).
"""
from __future__ import annotations

import functools

import torch

from cpkv.kernels.fp8_gemm.gluon_ws import expert_slots
from cpkv.kernels.grid import cdiv, check_grid, flat_grid

try:
    import triton
    import triton.language as tl

    _jit = triton.jit
except ImportError:  # no Triton (CPU machines): the module imports; launching a kernel raises ImportError
    triton = tl = None

    def _jit(fn):
        return _Missing(fn.__name__)


class _Missing:
    """Stands for a kernel where Triton is not installed: launching it raises ImportError naming it."""

    def __init__(self, name: str):
        self.name = name

    def __getitem__(self, grid):
        raise ImportError(f"kernel {self.name}: expected Triton to be installed, it is not")

GROUP = 128
QUANT_ROWS = 16  # rows per program of the quantisation kernels (one 128-wide group each)


@_jit
def _store_quant(x, rows, rmask, cols, cmask, Q, S, g, stride_q, stride_sm, stride_sg):
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.div_rn(amax, 448.0)  # IEEE division, as the reference (a plain / is approximate on the GPU)
    safe = tl.where(scale > 0, scale, 1.0)
    q = tl.clamp(tl.div_rn(x, safe[:, None]), -448.0, 448.0)
    r64 = rows.to(tl.int64)
    tl.store(Q + r64[:, None] * stride_q + cols[None, :], q.to(Q.dtype.element_ty, fp_downcast_rounding="rtne"),
             mask=rmask[:, None] & cmask[None, :])
    tl.store(S + r64 * stride_sm + g.to(tl.int64) * stride_sg, scale, mask=rmask)


@_jit
def _live_rows(M, NROWS, HAS_NROWS: tl.constexpr):
    """The rows a quantisation kernel covers: M, or at most the device count at NROWS (the rest untouched)."""
    if HAS_NROWS:
        return tl.minimum(M, tl.load(NROWS))
    return M


@_jit
def _act_quant(X, Q, S, M, K, stride_x, stride_q, stride_sm, stride_sg, G, NROWS, HAS_NROWS: tl.constexpr,
               BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    g, mb = pid % G, pid // G
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * 128 + tl.arange(0, 128)
    rmask, cmask = rows < _live_rows(M, NROWS, HAS_NROWS), cols < K
    r64 = rows.to(tl.int64)
    x = tl.load(X + r64[:, None] * stride_x + cols[None, :], mask=rmask[:, None] & cmask[None, :],
                other=0.0).to(tl.float32)
    _store_quant(x, rows, rmask, cols, cmask, Q, S, g, stride_q, stride_sm, stride_sg)


@_jit
def _swiglu_quant(GU, RW, Q, S, M, I, stride_gu, stride_q, stride_sm, stride_sg, G, NROWS,
                  HAS_NROWS: tl.constexpr, HAS_RW: tl.constexpr, BLOCK_M: tl.constexpr):
    pid = tl.program_id(0)
    g, mb = pid % G, pid // G
    rows = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = g * 128 + tl.arange(0, 128)
    rmask, cmask = rows < _live_rows(M, NROWS, HAS_NROWS), cols < I
    m2 = rmask[:, None] & cmask[None, :]
    base = GU + rows.to(tl.int64)[:, None] * stride_gu + cols[None, :]
    gate = tl.load(base, mask=m2, other=0.0).to(tl.float32)
    up = tl.load(base + I, mask=m2, other=0.0).to(tl.float32)
    a = tl.div_rn(gate, 1.0 + tl.exp(-gate)) * up
    if HAS_RW:
        a = a * tl.load(RW + rows, mask=rmask, other=0.0)[:, None]
    _store_quant(a, rows, rmask, cols, cmask, Q, S, g, stride_q, stride_sm, stride_sg)


TILE_M = 128  # default rows per tile; ``tile_ends`` is built per tile size
# Variants of the grouped GEMM: ``_grouped_v`` with these compile-time switches (absent: off), or the Gluon kernel.
# Its loads clamp row / column indices to the expert's last row / N - 1 (the stores stay masked) and drop the K
# masks whenever K % 128 == 0 (every real shape). Only the switches of the kept variants remain: the others were
# slower in the sweeps (BENCHMARKS.md).
#   TMA         A [R, K] and B [E * N, K] read through device-side TMA descriptors (out-of-range rows: zeros;
#               where TMA's stride rules are not met, e.g. K % 16 != 0, the call runs clamped pointer loads)
#   PERSISTENT  PERSISTENT programs per SM, each looping over tiles (column tiles fastest)
#   PREFETCH    (BLOCK_N <= 128) the next K block's two scales loaded one iteration ahead into registers, so
#               their latency is off the path from one block's dot to the next
#   EMAP        (E <= EMAP_MAX) every expert's tile count and row end loaded once per program into registers, a
#               tile's expert found by reductions over them instead of a binary search of dependent loads (a
#               chain of several microseconds at every tile start of a persistent program)
#   GLUON       not ``_grouped_v``: the warp-specialised Gluon kernel (``gluon_ws.py``: a TMA producer warp, two
#               consumer warpgroups that wgmma / wait / scale independently, so one's scaling overlaps the
#               other's wgmma; persistent programs, one per SM); its own PAIR (two K blocks' wgmmas in flight per
#               warpgroup) and GROUP_M (GROUP_M row tiles walked per column tile: neighbours share weight column
#               tiles in L2). Config: BLOCK_M and BLOCK_N 128, num_warps 4 (per warpgroup), num_stages the TMA
#               ring depth (2-6). Where it does not apply (not Hopper, N or K not multiples of 128, strides) the
#               call runs GLUON_FALLBACK.
#   EPI_TMA     (GLUON) the epilogue through shared memory: each consumer warpgroup writes its 64 x 128 half tile
#               to its own buffer and issues an asynchronous TMA store, waited for only a tile later, before the
#               buffer is reused; the expert's last, partial half tile is stored from registers, masked (a TMA
#               box would write the next expert's rows or the padding). 32 KB more shared memory (6 stages fit)
#   AHEAD       (GLUON) a tile's expert lookup and first scale loads issued before the previous tile's epilogue,
#               so their latency is off the next tile's first promotion
#   WIDE        (GLUON, not PAIR; N % 256 == 0 and c fit for EPI_TMA, else 128-column tiles) 128 x 256 tiles: per K block each consumer
#               runs two m64 n128 wgmmas, each waited for and promoted into its own accumulator; half the tiles
#               (per-tile costs) and a quarter less L2 -> shared traffic per FLOP; 48 KB stages (3 with EPI_TMA).
#               Registered only with EPI_TMA and AHEAD: the other combinations spill in the K loop (ptxas)
# Kept: the model's kernel (GROUPED), the next two Gluon forms as sweep baselines, and two Triton ones: v16 (the
# fastest Triton variant, GLUON_FALLBACK) and v4 (its baseline). At BLOCK_N <= 128 the weight scale of a K block
# is one scalar per program (loaded once, not per column).
VARIANTS: dict[str, dict] = {
    "gluon_ws_n256_g8_tma_ah": {"GLUON": True, "GROUP_M": 8, "EPI_TMA": True, "AHEAD": True, "WIDE": True},
    "gluon_ws_pair_g8_tma_ah": {"GLUON": True, "PAIR": True, "GROUP_M": 8, "EPI_TMA": True, "AHEAD": True},
    "gluon_ws_g8_tma_ah": {"GLUON": True, "GROUP_M": 8, "EPI_TMA": True, "AHEAD": True},
    "v4": {"TMA": True, "PERSISTENT": 1},
    "v16": {"TMA": True, "PERSISTENT": 1, "PREFETCH": True, "EMAP": True},
}
EMAP_MAX = 1024  # experts the EMAP switch holds in registers (more: the binary search)
# the Triton kernel a GLUON variant's call runs where the Gluon kernel does not apply (same 128-row tile map): the
# fastest Triton variant at its fastest config (BENCHMARKS.md, GLM-5's gate_up / down)
GLUON_FALLBACK = ("v16", {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 8, "num_stages": 4})
# The kernel the model runs (``model.experts.grouped_swiglu``): a VARIANTS key and None (autotune over the
# variant's configs at TILE_M rows) or one config {"BLOCK_M", "BLOCK_N", "num_warps", "num_stages"}
# (benchmarks/grouped_fp8_sweep.py measures them and prints the line to put here).
GROUPED: dict = {"variant": "gluon_ws_n256_g8_tma_ah", "config": {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": 2}}
# the Triton variants' autotune configs when no config is given: (BLOCK_N, num_warps, num_stages)
V_CONFIGS = [(128, 8, 3), (128, 8, 4), (256, 8, 3), (128, 4, 3), (128, 4, 4)]


@_jit
def _expert_of(TILE_END, pid_m, E, LOG_E: tl.constexpr):
    """The first expert whose cumulative tile count passes pid_m (E when none): binary search on the device."""
    lo = pid_m * 0
    hi = lo + E
    for _ in tl.static_range(LOG_E):
        mid = (lo + hi) // 2
        v = tl.load(TILE_END + mid, mask=mid < E, other=2147483647)
        right = v <= pid_m
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right, hi, mid)
    return lo


@_jit
def _tile(A, AS, OFFS, TILE_END, B, BS, C, a_desc, b_desc, t, n_tiles, E, N, K, stride_a, stride_as, stride_asg,
          stride_be, stride_bn, stride_bse, stride_bsn, stride_c, e_idx, e_ends, e_rows,
          LOG_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
          TMA: tl.constexpr, PREFETCH: tl.constexpr, EMAP: tl.constexpr):
    """Output tile t (row tile t // n_tiles, column tile t % n_tiles) of ``_grouped_v``: finds its expert
    (switches: VARIANTS' comment) and runs ``_tile_body`` unless the row tile lies past the last expert's."""
    pid_m = t // n_tiles
    pid_n = t % n_tiles
    if EMAP:  # the expert map in registers (``_grouped_v``): reductions, no dependent loads
        expert = tl.sum((e_ends <= pid_m).to(tl.int32), axis=0)
        first_tile = tl.sum(tl.where(e_idx == expert - 1, e_ends, 0), axis=0)
        row_start = tl.sum(tl.where(e_idx == expert - 1, e_rows, 0), axis=0)
        row_end = tl.sum(tl.where(e_idx == expert, e_rows, 0), axis=0)
        if expert < E:
            _tile_body(A, AS, B, BS, C, a_desc, b_desc, pid_m, pid_n, expert, first_tile, row_start, row_end, N, K,
                       stride_a, stride_as, stride_asg, stride_be, stride_bn, stride_bse, stride_bsn, stride_c,
                       BLOCK_M, BLOCK_N, EVEN_K, TMA, PREFETCH)
    else:
        expert = _expert_of(TILE_END, pid_m, E, LOG_E)
        if expert < E:
            first_tile = tl.load(TILE_END + expert - 1, mask=expert > 0, other=0)
            row_start = tl.load(OFFS + expert - 1, mask=expert > 0, other=0)
            row_end = tl.load(OFFS + expert)
            _tile_body(A, AS, B, BS, C, a_desc, b_desc, pid_m, pid_n, expert, first_tile, row_start, row_end, N, K,
                       stride_a, stride_as, stride_asg, stride_be, stride_bn, stride_bse, stride_bsn, stride_c,
                       BLOCK_M, BLOCK_N, EVEN_K, TMA, PREFETCH)


@_jit
def _tile_body(A, AS, B, BS, C, a_desc, b_desc, pid_m, pid_n, expert, first_tile, row_start, row_end, N, K,
               stride_a, stride_as, stride_asg, stride_be, stride_bn, stride_bse, stride_bsn, stride_c,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr, TMA: tl.constexpr,
               PREFETCH: tl.constexpr):
    """The tile of rows row_start + (pid_m - first_tile) * BLOCK_M ... (< row_end) of ``expert``, columns
    pid_n * BLOCK_N ...: the K loop (loads at clamped indices) and the masked store."""
    row0 = row_start + (pid_m - first_tile) * BLOCK_M
    col0 = pid_n * BLOCK_N
    rows = row0 + tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    rmask = rows < row_end
    cmask = cols < N
    rows_ld = tl.minimum(rows, row_end - 1)
    cols_ld = tl.minimum(cols, N - 1)
    r64 = rows_ld.to(tl.int64)
    c64 = cols_ld.to(tl.int64)
    e64 = expert.to(tl.int64)
    ks = tl.arange(0, 128)
    a_ptr = A + r64[:, None] * stride_a + ks[None, :]
    b_ptr = B + e64 * stride_be + c64[None, :] * stride_bn + ks[:, None]
    as_ptr = AS + r64 * stride_as
    if BLOCK_N <= 128:
        bs_ptr = BS + e64 * stride_bse + (col0 // 128).to(tl.int64) * stride_bsn
    else:
        bs_ptr = BS + e64 * stride_bse + (c64 // 128) * stride_bsn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    n_kb = tl.cdiv(K, 128)
    if PREFETCH:  # (the launcher sets it only with BLOCK_N <= 128): block 0's scales
        sa_n = tl.load(as_ptr)
        sb_n = tl.load(bs_ptr)
    for kb in range(0, n_kb):
        if TMA:
            a = a_desc.load([row0, kb * 128])
            b = b_desc.load([expert * N + col0, kb * 128]).T
        elif EVEN_K:
            a = tl.load(a_ptr)
            b = tl.load(b_ptr)
        else:
            kmask = kb * 128 + ks < K
            a = tl.load(a_ptr, mask=kmask[None, :], other=0.0)
            b = tl.load(b_ptr, mask=kmask[:, None], other=0.0)
        if PREFETCH:  # this block's scales were loaded one iteration ago; load the next block's now
            sa = sa_n
            sb = sb_n
            kn = tl.minimum(kb + 1, n_kb - 1)
            sa_n = tl.load(as_ptr + kn * stride_asg)
            sb_n = tl.load(bs_ptr + kn)
        else:
            sa = tl.load(as_ptr + kb * stride_asg)
            sb = tl.load(bs_ptr + kb)
        if BLOCK_N <= 128:
            acc += tl.dot(a, b, out_dtype=tl.float32) * (sa * sb)[:, None]
        else:
            acc += tl.dot(a, b, out_dtype=tl.float32) * sa[:, None] * sb[None, :]
        a_ptr += 128
        b_ptr += 128
    tl.store(C + rows.to(tl.int64)[:, None] * stride_c + cols.to(tl.int64)[None, :], acc.to(C.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


@_jit
def _grouped_v(A, AS, OFFS, TILE_END, B, BS, C, R, E, N, K, stride_a, stride_as, stride_asg, stride_be, stride_bn,
               stride_bse, stride_bsn, stride_c,
               LOG_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, EVEN_K: tl.constexpr,
               TMA: tl.constexpr, PERSISTENT: tl.constexpr, PREFETCH: tl.constexpr, EMAP: tl.constexpr,
               EP: tl.constexpr):
    if TMA:
        a_desc = tl.make_tensor_descriptor(A, shape=[R, K], strides=[stride_a, 1], block_shape=[BLOCK_M, 128])
        b_desc = tl.make_tensor_descriptor(B, shape=[E * N, K], strides=[stride_bn, 1], block_shape=[BLOCK_N, 128])
    else:
        a_desc = A
        b_desc = B
    n_tiles = tl.cdiv(N, BLOCK_N)
    total = tl.load(TILE_END + E - 1) * n_tiles
    if EMAP:  # every expert's cumulative tile count and row end, loaded once per program (padding: INT_MAX, 0)
        e_idx = tl.arange(0, EP)
        e_ends = tl.load(TILE_END + e_idx, mask=e_idx < E, other=2147483647)
        e_rows = tl.load(OFFS + e_idx, mask=e_idx < E, other=0)
    else:
        e_idx = 0
        e_ends = 0
        e_rows = 0
    if PERSISTENT:
        for t in range(tl.program_id(0), total, tl.num_programs(0)):
            _tile(A, AS, OFFS, TILE_END, B, BS, C, a_desc, b_desc, t, n_tiles, E, N, K, stride_a, stride_as,
                  stride_asg, stride_be, stride_bn, stride_bse, stride_bsn, stride_c, e_idx, e_ends, e_rows, LOG_E,
                  BLOCK_M, BLOCK_N, EVEN_K, TMA, PREFETCH, EMAP)
    else:
        t = tl.program_id(0)
        if t < total:
            _tile(A, AS, OFFS, TILE_END, B, BS, C, a_desc, b_desc, t, n_tiles, E, N, K, stride_a, stride_as,
                  stride_asg, stride_be, stride_bn, stride_bse, stride_bsn, stride_c, e_idx, e_ends, e_rows, LOG_E,
                  BLOCK_M, BLOCK_N, EVEN_K, TMA, PREFETCH, EMAP)


def act_quant(x: torch.Tensor, q: torch.Tensor, s: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """x [M, K] -> q fp8 [M, K] (contiguous rows), s float32 (M, ceil(K/128)) in its own strides. ``rows``: an
    int32 device tensor whose first value bounds the rows quantised (rows past it untouched; a static buffer
    whose real row count stays on the device, as the expert exchange's)."""
    m, k = x.shape
    if m == 0:
        return
    g = cdiv(k, GROUP)
    _act_quant[check_grid(flat_grid(g, cdiv(m, QUANT_ROWS)))](
        x, q, s, m, k, x.stride(0), q.stride(0), s.stride(0), s.stride(1), g, s if rows is None else rows,
        HAS_NROWS=rows is not None, BLOCK_M=QUANT_ROWS, num_warps=4)


def swiglu_quant(gu: torch.Tensor, rw: torch.Tensor | None, q: torch.Tensor, s: torch.Tensor,
                 rows: torch.Tensor | None = None) -> None:
    """gu [M, 2I] (gate | up), rw float32 [M] or None -> q fp8 [M, I], s float32 (M, ceil(I/128)); ``rows`` as
    ``act_quant``'s."""
    m, i = q.shape
    if m == 0:
        return
    g = cdiv(i, GROUP)
    _swiglu_quant[check_grid(flat_grid(g, cdiv(m, QUANT_ROWS)))](
        gu, gu if rw is None else rw, q, s, m, i, gu.stride(0), q.stride(0), s.stride(0), s.stride(1), g,
        s if rows is None else rows, HAS_NROWS=rows is not None, HAS_RW=rw is not None, BLOCK_M=QUANT_ROWS,
        num_warps=4)


def tile_m() -> int:
    """Rows per tile of the selected kernel (GROUPED): the tile size ``tile_ends`` builds its map for."""
    cfg = GROUPED["config"]
    return int(cfg.get("BLOCK_M", TILE_M)) if cfg else TILE_M


def tile_ends(offs: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """offs int32 [E] cumulative row ends -> int32 [E] cumulative counts of ``block_m``-row tiles (default:
    the selected kernel's, ``tile_m()``), on the device."""
    bm = tile_m() if block_m is None else block_m
    counts = torch.diff(offs, prepend=offs.new_zeros(1))
    return torch.cumsum(torch.div(counts + (bm - 1), bm, rounding_mode="floor"), 0, dtype=torch.int32)


_SCALAR_N = ("PREFETCH",)  # switches that need BLOCK_N <= 128 (one weight scale per K block)


@functools.cache
def _tuned(variant: str):
    """The autotuned kernel of ``variant`` (built on first use: Triton is imported only where installed)."""
    scalar = any(VARIANTS[variant].get(f, False) for f in _SCALAR_N)
    return triton.autotune(configs=[triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
                                    for bn, w, st in V_CONFIGS if bn <= 128 or not scalar],
                           key=["N", "K"])(_grouped_v)


@functools.cache
def _tma_allocator() -> None:
    """Device-side TMA descriptors need a global scratch allocator (set once per process)."""
    def alloc(size: int, alignment: int, stream):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    triton.set_allocator(alloc)


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def grouped_gemm(a: torch.Tensor, a_s: torch.Tensor, offs: torch.Tensor, b: torch.Tensor, b_s: torch.Tensor,
                 c: torch.Tensor, tiles: torch.Tensor | None = None, config: dict | None = None,
                 variant: str | None = None) -> None:
    """c [R, N] (rows < offs[-1]) = the block-scaled product of each expert's rows (module docstring).
    ``variant``: a VARIANTS key (default GROUPED's, with GROUPED's config); ``config``: {"BLOCK_M",
    "BLOCK_N", "num_warps", "num_stages"} instead of autotuning; ``tiles``: ``tile_ends(offs, BLOCK_M)`` when
    the caller has it (one per set of offsets and tile size)."""
    r, k = a.shape
    e, n, _ = b.shape
    if r == 0 or e == 0:
        return
    if variant is None:
        variant, config = GROUPED["variant"], GROUPED["config"] if config is None else config
    if variant not in VARIANTS:
        raise ValueError(f"grouped GEMM variant: expected one of {', '.join(VARIANTS)}, got {variant!r}")
    if VARIANTS[variant].get("GLUON"):
        if _gluon(variant, a, a_s, offs, b, b_s, c, tiles, config):
            return
        variant, config = GLUON_FALLBACK
    config = dict(config) if config else None
    bm = config.pop("BLOCK_M", TILE_M) if config else TILE_M
    tiles = tile_ends(offs, bm) if tiles is None else tiles
    flags = dict(VARIANTS[variant])
    if flags.get("TMA"):
        # TMA wants unit K strides, 16-byte row strides and b's experts back to back; elsewhere: pointer loads
        if (a.stride(1) != 1 or b.stride(2) != 1 or b.stride(0) != n * b.stride(1) or a.stride(0) % 16
                or b.stride(1) % 16):
            flags["TMA"] = False
        else:
            _tma_allocator()
    persistent = int(flags.get("PERSISTENT", 0))
    scalar = [f for f in _SCALAR_N if flags.get(f)]
    if scalar and config is not None and config["BLOCK_N"] > 128:
        raise ValueError(f"grouped GEMM {variant} ({', '.join(scalar)}): expected BLOCK_N <= 128, "
                         f"got {config['BLOCK_N']}")

    def grid(meta: dict) -> tuple[int]:
        bound = (cdiv(r, bm) + e) * cdiv(n, meta["BLOCK_N"])
        if persistent:
            bound = min(bound, persistent * _sm_count(a.device.index or 0))
        return check_grid((bound,))

    args = (a, a_s, offs, tiles, b, b_s, c, r, e, n, k, a.stride(0), a_s.stride(0), a_s.stride(1), b.stride(0),
            b.stride(1), b_s.stride(0), b_s.stride(1), c.stride(0))
    meta = {"LOG_E": e.bit_length(), "BLOCK_M": bm, "EVEN_K": k % 128 == 0, "TMA": bool(flags.get("TMA")),
            "PERSISTENT": persistent, "PREFETCH": bool(flags.get("PREFETCH")),
            "EMAP": bool(flags.get("EMAP")) and e <= EMAP_MAX, "EP": expert_slots(e)}
    (_tuned(variant) if config is None else _grouped_v)[grid](*args, **meta, **(config or {}))


def _gluon(variant: str, a: torch.Tensor, a_s: torch.Tensor, offs: torch.Tensor, b: torch.Tensor,
           b_s: torch.Tensor, c: torch.Tensor, tiles: torch.Tensor | None, config: dict | None) -> bool:
    """Run a GLUON variant's warp-specialised kernel; False (nothing launched) where it does not apply. A
    config other than 128 x 128 tiles at 4 warps per warpgroup raises ValueError (a caller's mistake)."""
    from cpkv.kernels.fp8_gemm import gluon_ws

    stages = gluon_ws.WIDE_STAGES if VARIANTS[variant].get("WIDE") else gluon_ws.STAGES
    cfg = {"BLOCK_M": 128, "BLOCK_N": 128, "num_warps": 4, "num_stages": stages, **(config or {})}
    if (cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_warps"]) != (128, 128, 4):
        raise ValueError(f"grouped GEMM {variant} (Gluon, warp-specialised): expected BLOCK_M 128, BLOCK_N 128, "
                         f"num_warps 4, got {cfg['BLOCK_M']}, {cfg['BLOCK_N']}, {cfg['num_warps']}")
    if gluon_ws.applies(a, b, c) is not None:
        return False
    flags = VARIANTS[variant]
    gluon_ws.launch(a, a_s, offs, b, b_s, c, tile_ends(offs, 128) if tiles is None else tiles,
                    stages=int(cfg["num_stages"]), pair=bool(flags.get("PAIR")), group_m=int(flags.get("GROUP_M", 1)),
                    epi_tma=bool(flags.get("EPI_TMA")), ahead=bool(flags.get("AHEAD")), wide=bool(flags.get("WIDE")))
    return True

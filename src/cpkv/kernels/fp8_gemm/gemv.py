"""Block-scaled fp8 GEMV / skinny GEMM for few rows (decode): streams the weight once, at close to the copy rate.

    gemv(q fp8 [M, K], s float32 (M, K/128) any strides, w fp8 [N, K] (K contiguous),
         ws float32 [ceil(N/128), K/128] any strides, out [M, N] | None, tickets int32 | None) -> out [M, N] (bf16)
        out[m, n] = sum_g (q[m, g] . w[n, g]) * s[m, g] * ws[n // 128, g] over the K groups g of 128, accumulated in
        float32: ``torch._scaled_mm``'s block-scaled product of the quantised activation (reference:
        ``ref.fp8_linear_quant_ref``). 1 <= M <= MAX_ROWS, any N, K a positive multiple of 128.

The product is read-bound (2 M FLOPs per weight byte), so the layout serves the weight stream: a program owns a
BLOCK_N x (a range of K groups) slab of the weight, read in [BLOCK_N, 128] tiles (TMA boxes, or 16-byte vector
loads) through a ``num_stages``-deep pipeline. Per tile one tensor-core product with the operands swapped,
w [BLOCK_N, 128] x q^T [128, BM] -> float32 [BLOCK_N, BM] (BM = M rounded up to 16, 32 or 64: the rows a tile's
instruction covers; rows past M read row M - 1 and are never stored), scaled by s[m, g] * ws[n // 128, g] and
added into a float32 accumulator: the per-group promotion of the block-scaled format. BLOCK_N divides 128, so a
program's rows share one weight scale per group.

Split K: ``plan`` gives each of the cdiv(N, BLOCK_N) column tiles ``split`` programs, each over ``per``
consecutive K groups: as many equal programs as fit on the SMs at once (``RESIDENT`` per SM), so every SM
streams from the start and no second, partial wave of programs trails the first. With split 1 a program
stores its rows of out directly. Otherwise each program stores its float32 partial [M, BLOCK_N] into a
workspace [split, M, N] and the tile's sum is made in a fixed order, s = 0, 1, ..., so the output does not
depend on which program finished first (deterministic run to run; and batch to batch within one BM: a row's
value does not depend on the other rows, and the split depends on N, K, BM and the SM count only):

* ticket (default): each program, after its store, takes a ticket from the tile's int32 counter (one atomic,
  acq_rel at GPU scope, after a barrier of the program's threads: CUTLASS's semaphore pattern); the program that
  takes the last ticket sums the tile's partials (read through L2) into out and resets the counter to 0, so the
  counters are left zeroed for the next call. ``tickets`` (``new_tickets(n)``, zeroed once and owned by the
  caller: a Linear) must not be shared by launches that may run at the same time (another stream); without it a
  zeroed one is allocated per call (a memset).
* reduce: a second kernel sums the partials (one more launch; no counters).

No host sync, no reads back: every size is host metadata, so a call can be captured in a CUDA graph (the
workspace comes from the caching allocator in stream order). The module imports without Triton (its kernels then
raise ImportError when launched), as ``triton.py``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from cpkv.config import FP8_GEMV_MAX_ROWS as MAX_ROWS  # the largest M a launch takes (BM 64)
from cpkv.errors import GemvError
from cpkv.kernels import platform
from cpkv.kernels.fp8_gemm.triton import _jit, tl  # Triton optional: launching without it raises ImportError
from cpkv.kernels.grid import cdiv, check_grid

GROUP = 128          # K per activation group and per weight block (and rows per weight block)
MIN_BLOCK_N = 32     # the smallest column tile: ``new_tickets`` sizes its counters by it
FP8 = torch.float8_e4m3fn
_OUT_TYPES = (torch.bfloat16, torch.float16, torch.float32)
REDUCES = ("ticket", "reduce")


# Programs of the default config that fit on one SM at once, per BM: registers (ptxas: 80, 132, 215 per thread of
# 128) and shared memory (3 stages of w and q tiles: 55, 61, 74 KB) of sm_90; tests/kernels/test_fp8_gemv.py
# compiles the kernel offline and checks them
RESIDENT = {16: 4, 32: 3, 64: 2}


@dataclass(frozen=True)
class GemvConfig:
    """Launch choices. ``block_n``: weight rows per program (divides 128, >= MIN_BLOCK_N); ``waves``: programs
    aimed at per SM (None: RESIDENT's, one wave of programs all resident at once); ``min_groups``: the fewest K
    groups a split program streams; ``tma``: weight and activation tiles as TMA boxes (host-side descriptors, where
    the strides allow; else pointer loads); ``reduce``: REDUCES (module docstring)."""

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 3
    waves: int | None = None
    min_groups: int = 4
    tma: bool = True
    reduce: str = "ticket"

    def __post_init__(self) -> None:
        if self.block_n < MIN_BLOCK_N or GROUP % self.block_n:
            raise GemvError(f"GemvConfig.block_n: expected a divisor of {GROUP} >= {MIN_BLOCK_N}, got {self.block_n}")
        if self.reduce not in REDUCES:
            raise GemvError(f"GemvConfig.reduce: expected one of {', '.join(REDUCES)}, got {self.reduce!r}")
        if min(self.num_warps, self.num_stages, self.waves or 1, self.min_groups) < 1:
            raise GemvError(f"GemvConfig: expected num_warps, num_stages, waves, min_groups >= 1, got {self}")


DEFAULT = GemvConfig()


@dataclass(frozen=True)
class Plan:
    """One launch's geometry: BM rows per tile, ``tiles`` column tiles x ``split`` programs of ``per`` K groups."""

    bm: int
    tiles: int
    split: int
    per: int

    @property
    def programs(self) -> int:
        return self.tiles * self.split


def block_rows(m: int) -> int:
    """BM: the rows one tile's product covers, M rounded up to 16, 32 or 64."""
    return max(16, 1 << (m - 1).bit_length())


def plan(m: int, n: int, k: int, sms: int, cfg: GemvConfig = DEFAULT) -> Plan:
    """The split of [N, K] for ``sms`` SMs: each column tile gets split = min(waves x SMs // tiles,
    groups // min_groups) programs (at least 1) of per = cdiv(groups, split) groups, split recomputed from per (no
    program empty): at most one wave of equal programs, every one resident from the start, so they finish together.
    M picks BM, and BM the default waves: for M of one BM the split, and so the summation order, is the same."""
    bm = block_rows(m)
    tiles, groups = cdiv(n, cfg.block_n), k // GROUP
    waves = cfg.waves or RESIDENT[bm]
    split = max(1, min(waves * sms // tiles, groups // cfg.min_groups))
    per = cdiv(groups, split)
    return Plan(bm, tiles, cdiv(groups, per), per)


def new_tickets(n: int, device: torch.device | str) -> torch.Tensor:
    """int32 counters for the column tiles of an N-row weight at any block_n, zeroed (module docstring)."""
    return torch.zeros(cdiv(n, MIN_BLOCK_N), dtype=torch.int32, device=device)


def check(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, ws: torch.Tensor) -> None:
    """GemvError unless q fp8 [M, K] (1 <= M <= MAX_ROWS), s float32 [M, K/128], w fp8 [N, K], ws float32
    [ceil(N/128), K/128], K a positive multiple of 128, q and w with unit K stride (host metadata only)."""
    (m, k), (n, kw) = q.shape, w.shape
    if q.dtype != FP8 or w.dtype != FP8:
        raise GemvError(f"fp8 GEMV: expected float8_e4m3fn q and w, got {q.dtype} and {w.dtype}")
    if not 1 <= m <= MAX_ROWS:
        raise GemvError(f"fp8 GEMV: expected 1 to {MAX_ROWS} rows, got {m}")
    if k != kw or k % GROUP or k == 0 or n == 0:
        raise GemvError(f"fp8 GEMV: expected q [M, K] and w [N, K] with K a positive multiple of {GROUP}, N > 0, "
                        f"got q {list(q.shape)}, w {list(w.shape)}")
    if q.stride(1) != 1 or w.stride(1) != 1:
        raise GemvError(f"fp8 GEMV: expected unit K strides, got q {q.stride()}, w {w.stride()}")
    g = k // GROUP
    for name, t, shape in (("s", s, (m, g)), ("ws", ws, (cdiv(n, GROUP), g))):
        if t.dtype != torch.float32 or tuple(t.shape) != shape:
            raise GemvError(f"fp8 GEMV: expected {name} float32 {list(shape)}, got {t.dtype} {list(t.shape)}")


def _tma_ready(q: torch.Tensor, w: torch.Tensor) -> bool:
    """16-byte aligned bases and row strides (unit K strides are checked already): TMA boxes apply."""
    return all(t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0 for t in (q, w))


def gemv(q: torch.Tensor, s: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, out: torch.Tensor | None = None,
         tickets: torch.Tensor | None = None, cfg: GemvConfig = DEFAULT, dtype: torch.dtype = torch.bfloat16,
         sms: int | None = None) -> torch.Tensor:
    """out [M, N] = the block-scaled product (module docstring); ``out`` given: written in place (any row stride,
    unit column stride, a dtype of _OUT_TYPES), else a new ``dtype`` tensor. ``tickets``: the caller's zeroed
    counters (``new_tickets``) for the ticket reduction; ``sms``: the SM count the split is planned for (default:
    the device's; tests pass a small one). Raises GemvError on operands outside the contract."""
    check(q, s, w, ws)
    (m, k), n = q.shape, w.shape[0]
    out = _output(out, m, n, dtype, q.device)
    p = plan(m, n, k, sms or _sms(q), cfg)
    mode = 0 if p.split == 1 else 1 if cfg.reduce == "ticket" else 2
    part = torch.empty(p.split * m * n if p.split > 1 else 1, dtype=torch.float32, device=q.device)
    tickets = _tickets(tickets, p.tiles, n, q.device) if mode == 1 else part
    tma = cfg.tma and _tma_ready(q, w)
    q_arg, w_arg = (_descriptor(q, p.bm), _descriptor(w, cfg.block_n)) if tma else (q, w)
    _gemv[check_grid((p.programs,))](
        q_arg, s, w_arg, ws, out, part, tickets, m, n, k, q.stride(0), s.stride(0), s.stride(1), w.stride(0),
        ws.stride(0), ws.stride(1), out.stride(0), p.split, p.per,
        BM=p.bm, BN=cfg.block_n, TMA=tma, MODE=mode, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if mode == 2:
        _reduce[check_grid((p.tiles,))](part, out, m, n, out.stride(0), p.split, BM=p.bm, BN=cfg.block_n,
                                        num_warps=4)
    return out


def _output(out: torch.Tensor | None, m: int, n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``out`` checked, or a new [m, n] ``dtype`` tensor."""
    out = torch.empty(m, n, dtype=dtype, device=device) if out is None else out
    if tuple(out.shape) != (m, n) or out.dtype not in _OUT_TYPES or out.stride(1) != 1 or out.device != device:
        raise GemvError(f"fp8 GEMV: expected out [{m}, {n}] of {', '.join(map(str, _OUT_TYPES))} on {device} with "
                        f"unit column stride, got {out.dtype} {list(out.shape)} strides {out.stride()} on {out.device}")
    return out


def _tickets(tickets: torch.Tensor | None, tiles: int, n: int, device: torch.device) -> torch.Tensor:
    """The caller's counters, checked, or zeroed new ones (a memset per call)."""
    if tickets is None:
        return new_tickets(n, device)
    if tickets.dtype != torch.int32 or tickets.numel() < tiles or tickets.device != device:
        raise GemvError(f"fp8 GEMV: expected tickets int32 [>= {tiles}] on {device} (new_tickets), got "
                        f"{tickets.dtype} {list(tickets.shape)} on {tickets.device}")
    return tickets


def _sms(x: torch.Tensor) -> int:
    return platform.sm_count(x) if x.is_cuda else 4


def _descriptor(t: torch.Tensor, rows: int):
    """A host-side TMA descriptor of t [R, K] in [rows, 128] boxes (rows past R read as zeros): a kernel argument,
    so no program builds one on the device."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor(t, list(t.shape), list(t.stride()), [rows, GROUP])


@_jit
def _reduce_tile(PART, Y, pid_n, M, N, stride_y, split, BM: tl.constexpr, BN: tl.constexpr):
    """out[:, tile] = ((PART[0] + PART[1]) + PART[2]) + ... over the tile's split partials (float32, in this order),
    read through L2, UNROLL partials' loads issued before they are added (their latencies overlap; a partial past
    the split reads as 0.0, which leaves the sum unchanged)."""
    UNROLL: tl.constexpr = 64 // BM  # UNROLL x BM x BN float32 in flight per program: 32 K registers at BN 128
    rows = tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    ptr = PART + rows.to(tl.int64)[:, None] * N + cols[None, :]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    step = M * N
    for s0 in range(0, split, UNROLL):
        p0 = tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg")
        if UNROLL >= 2:
            p1 = tl.load(ptr + step, mask=mask & (s0 + 1 < split), other=0.0, cache_modifier=".cg")
        if UNROLL >= 4:
            p2 = tl.load(ptr + 2 * step, mask=mask & (s0 + 2 < split), other=0.0, cache_modifier=".cg")
            p3 = tl.load(ptr + 3 * step, mask=mask & (s0 + 3 < split), other=0.0, cache_modifier=".cg")
        acc += p0
        if UNROLL >= 2:
            acc += p1
        if UNROLL >= 4:
            acc += p2
            acc += p3
        ptr += UNROLL * step
    tl.store(Y + rows.to(tl.int64)[:, None] * stride_y + cols[None, :], acc.to(Y.dtype.element_ty), mask=mask)


@_jit
def _gemv(Q, S, W, WS, Y, PART, TICKETS, M, N, K, stride_q, stride_sm, stride_sg, stride_w, stride_wsn,
          stride_wsg, stride_y, split, per, BM: tl.constexpr, BN: tl.constexpr, TMA: tl.constexpr,
          MODE: tl.constexpr):
    """MODE 0: split 1, out stored directly; 1: partials + the ticket reduction; 2: partials only."""
    pid = tl.program_id(0)
    pid_n = pid // split
    pid_k = pid - pid_n * split
    g0 = pid_k * per
    g1 = tl.minimum(g0 + per, K // 128)
    n0 = pid_n * BN
    cols = n0 + tl.arange(0, BN)
    rows = tl.arange(0, BM)
    rows_ld = tl.minimum(rows, M - 1).to(tl.int64)
    ks = tl.arange(0, 128)
    if not TMA:
        w_ptr = W + tl.minimum(cols, N - 1).to(tl.int64)[:, None] * stride_w + ks[None, :]
        q_ptr = Q + rows_ld[:, None] * stride_q + ks[None, :]
    s_ptr = S + rows_ld * stride_sm
    ws_ptr = WS + (n0 // 128).to(tl.int64) * stride_wsn
    sa_n = tl.load(s_ptr + g0 * stride_sg)  # the scales are loaded one group ahead (their latency off the loop)
    sw_n = tl.load(ws_ptr + g0 * stride_wsg)
    acc = tl.zeros((BN, BM), dtype=tl.float32)
    for g in range(g0, g1):
        scale = sa_n * sw_n
        gn = tl.minimum(g + 1, g1 - 1)
        sa_n = tl.load(s_ptr + gn * stride_sg)
        sw_n = tl.load(ws_ptr + gn * stride_wsg)
        if TMA:
            w = W.load([n0, g * 128])
            q = Q.load([0, g * 128])
        else:
            w = tl.load(w_ptr + g * 128)
            q = tl.load(q_ptr + g * 128)
        acc += tl.dot(w, q.T, out_dtype=tl.float32) * scale[None, :]
    out = acc.T  # [BM, BN]
    r64 = rows.to(tl.int64)
    mask = (rows < M)[:, None] & (cols < N)[None, :]
    if MODE == 0:
        tl.store(Y + r64[:, None] * stride_y + cols[None, :], out.to(Y.dtype.element_ty), mask=mask)
    else:
        tl.store(PART + (pid_k.to(tl.int64) * M + r64)[:, None] * N + cols[None, :], out, mask=mask)
        if MODE == 1:
            tl.debug_barrier()  # every thread's partial stored before the ticket's release
            ticket = tl.atomic_add(TICKETS + pid_n, 1, sem="acq_rel", scope="gpu")
            if ticket == split - 1:
                _reduce_tile(PART, Y, pid_n, M, N, stride_y, split, BM, BN)
                tl.atomic_xchg(TICKETS + pid_n, 0, sem="relaxed", scope="gpu")


@_jit
def _reduce(PART, Y, M, N, stride_y, split, BM: tl.constexpr, BN: tl.constexpr):
    _reduce_tile(PART, Y, tl.program_id(0), M, N, stride_y, split, BM, BN)


"""Triton kernel for the lightning indexer's MQA logits (docs/design.md, indexer); reference: cpkv.kernels.mqa_logits.ref.

    out[i, c] = k_scale[j] * sum_h w[i, h] * relu(q[i, h, :] . k[j, :]),  j = col_offset + c,
                -inf where j is outside [ks[i], ke[i])

q: [T, H, D] float8_e4m3fn or bfloat16 (head rows contiguous), k: [S, D] float8_e4m3fn or bfloat16
(any row stride, unit column stride: the 132-byte index rows are read in place), k_scale: [S] float32
(any stride), w: [T, H] float32, ks/ke: [T] int32, out: [T, n_cols] float32 (any row stride).

Tiling: one program owns BQ query tokens (so N = BQ*H query rows, as the N side of one tensor-core
dot) and a span of SPAN key tiles of BLOCK_S keys (the M side). Per key tile one dot
[BLOCK_S, D] x [D, BQ*H] gives every (key, token, head) score; relu, weights and the head sum run on
the accumulator in registers. Key tiles outside the union [min ks, max ke) of the program's tokens are
never computed: with ``clean`` they are filled with -inf, otherwise left unwritten.

Kernels (LogitsConfig.variant). mqa_logits_kernel_lanes ("lanes", any sm_80+ GPU): query rows permuted to
the accumulator's lane layout so the head sum is an in-thread FMNMX + FFMA chain, k_scale one tile ahead,
unclean calls skip the mask, key tiles by TMA where the GPU and k allow it (zero rows past S); its dot is
waited on before the epilogue of the same tile (Triton keeps no wgmma in flight across it), so tensor cores
and ALUs overlap only across programs. "gluon" (default): cpkv.kernels.mqa_logits.gluon on Hopper (fp8 q and
k, H <= 32, TMA-ready keys), which overlaps them explicitly; other inputs and GPUs run "lanes" with the same
config. An unclean call that is given a plan's work items (``work``, cpkv.kernels.mqa_logits.work;
index_topk does) launches the Gluon kernel once per non-empty (token group, key span) item, span by span,
instead of the full grid: a ragged batch then launches only the programs that have keys to compute. Speed
against the fp8 GEMM: BENCHMARKS.md (``cpkv bench indexer``).
"""
from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from cpkv.kernels.grid import logits_grid
from cpkv.kernels.mqa_logits.config import LogitsConfig
from cpkv.kernels.platform import capability, gluon_importable, sm_count

SUPPORTED_HEADS = (8, 16, 32, 64)
SUPPORTED_DIMS = (64, 128)


DEFAULT_CONFIG = LogitsConfig()
LANES_CONFIG = LogitsConfig(variant="lanes")


@triton.jit
def _column_token_head(n, BQ: tl.constexpr):
    """Column n of the N = BQ*H score tile -> (token, head), laid out for the tensor-core accumulator:
    a thread's columns are 2*(lane % 4) + e + 8*i (e in 0..1, i in 0..N/8), so a token's heads are
    placed on one lane of each quad (two for BQ = 2) and the head sum needs no cross-lane shuffle."""
    e = n % 2
    c = (n // 2) % 4
    i = n // 8
    if BQ >= 4:
        tok = c + 4 * (i % (BQ // 4))
        head = e + 2 * (i // (BQ // 4))
    else:
        tok = c // (4 // BQ)
        head = e + 2 * (c % (4 // BQ)) + 8 // BQ * i
    return tok, head


@triton.jit
def _head_sum_lanes(s, BLOCK_S: tl.constexpr, N: tl.constexpr, BQ: tl.constexpr):
    """[BLOCK_S, N] weighted scores in _column_token_head order -> [BLOCK_S, BQ] per-token sums."""
    if BQ >= 4:
        x = tl.permute(tl.reshape(s, [BLOCK_S, N // 8 // (BQ // 4), BQ // 4, 4, 2]), [0, 2, 3, 1, 4])
        x = tl.sum(tl.reshape(x, [BLOCK_S, BQ, N // BQ]), axis=2)  # one in-thread chain per token
    else:
        x = tl.permute(tl.reshape(s, [BLOCK_S, N // 8, BQ, 4 // BQ, 2]), [0, 2, 3, 1, 4])
        x = tl.sum(tl.reshape(x, [BLOCK_S, BQ, 4 // BQ, N // 8 * 2]), axis=3)
        x = tl.sum(x, axis=2)
    return x


@triton.jit
def mqa_logits_kernel_lanes(
    q_ptr, k_ptr, ksc_ptr, w_ptr, ks_ptr, ke_ptr, out_ptr,
    T, S, col_off, n_cols,
    stride_qt, stride_k, stride_ksc, stride_wt, stride_out,
    H: tl.constexpr, D: tl.constexpr, BQ: tl.constexpr, BLOCK_S: tl.constexpr,
    SPAN: tl.constexpr, CLEAN: tl.constexpr, CAST_BF16: tl.constexpr, K_ALIGN: tl.constexpr,
    k_desc, USE_TMA: tl.constexpr,
):
    """Variant "lanes" of mqa_logits_kernel (same tiling, same result up to float summation order):
    the query rows of the tile are permuted (_column_token_head) so each thread's accumulator
    columns hold whole heads of one token: relu, weight and head sum are in-thread FMNMX + FFMA
    with no shuffles; k_scale is loaded one tile ahead; with CLEAN off, columns outside [ks, ke)
    are not masked (they are unspecified), only -inf tiles/columns of a clean call are. USE_TMA:
    key tiles come through k_desc (a [S, D] tensor descriptor, block [BLOCK_S, D], rows past S read
    as zeros) instead of per-thread pointer loads."""
    N: tl.constexpr = BQ * H
    n_spans = tl.cdiv(n_cols, SPAN * BLOCK_S)  # flat grid (cpkv.kernels.grid.logits_grid): spans fastest
    pid_s = tl.program_id(0) % n_spans
    pid_t = tl.program_id(0) // n_spans
    t0 = pid_t * BQ
    offs_t = t0 + tl.arange(0, BQ)
    tmask = offs_t < T
    out_rows = out_ptr + offs_t.to(tl.int64) * stride_out  # T x n_cols may pass 2^31 elements
    ks_v = tl.load(ks_ptr + offs_t, mask=tmask, other=2147483647)
    ke_v = tl.load(ke_ptr + offs_t, mask=tmask, other=0)
    lo = tl.maximum(tl.min(ks_v, axis=0) - col_off, 0)
    hi = tl.minimum(tl.minimum(tl.max(ke_v, axis=0), S) - col_off, n_cols)
    span_lo = pid_s * (SPAN * BLOCK_S)
    span_hi = tl.minimum(span_lo + SPAN * BLOCK_S, n_cols)
    c_start = span_lo + (tl.maximum(lo - span_lo, 0) // BLOCK_S) * BLOCK_S
    c_end = tl.minimum(span_hi, hi)
    n_tiles = tl.maximum(c_end - c_start + BLOCK_S - 1, 0) // BLOCK_S
    offs_bs = tl.arange(0, BLOCK_S)
    if CLEAN:
        ninf = tl.full([BLOCK_S, BQ], float("-inf"), tl.float32)
        for c in range(span_lo, c_start, BLOCK_S):
            oc = c + offs_bs
            tl.store(out_rows[None, :] + oc[:, None], ninf,
                     mask=tmask[None, :] & (oc < span_hi)[:, None])
        for c in range(c_start + n_tiles * BLOCK_S, span_hi, BLOCK_S):
            oc = c + offs_bs
            tl.store(out_rows[None, :] + oc[:, None], ninf,
                     mask=tmask[None, :] & (oc < span_hi)[:, None])
    if n_tiles > 0:
        offs_n = tl.arange(0, N)
        offs_d = tl.arange(0, D)
        tok, head = _column_token_head(offs_n, BQ)
        n_tok = t0 + tok
        nmask = n_tok < T
        q_blk = tl.load(q_ptr + n_tok.to(tl.int64)[:, None] * stride_qt + head[:, None] * D + offs_d[None, :],
                        mask=nmask[:, None], other=0.0)
        if CAST_BF16:
            q_blk = q_blk.to(tl.bfloat16)
        q_t = tl.trans(q_blk)
        w = tl.load(w_ptr + n_tok * stride_wt + head, mask=nmask, other=0.0)
        j0 = c_start + col_off + offs_bs
        ksc = tl.load(ksc_ptr + j0 * stride_ksc, mask=j0 < S, other=0.0)
        for tile in range(0, n_tiles):
            oc = c_start + tile * BLOCK_S + offs_bs
            j = oc + col_off
            kmask = j < S
            if USE_TMA:
                k_blk = k_desc.load([c_start + col_off + tile * BLOCK_S, 0])
            else:
                k_blk = tl.load(k_ptr + (j * stride_k)[:, None] * K_ALIGN + offs_d[None, :], mask=kmask[:, None],
                                other=0.0)
            if CAST_BF16:
                k_blk = k_blk.to(tl.bfloat16)
            jn = j + BLOCK_S
            ksc_n = tl.load(ksc_ptr + jn * stride_ksc, mask=(jn < S) & (tile + 1 < n_tiles), other=0.0)
            s = tl.dot(k_blk, q_t)
            s = tl.maximum(s, 0.0) * w[None, :]
            val = _head_sum_lanes(s, BLOCK_S, N, BQ) * ksc[:, None]
            if CLEAN:
                valid = (j[:, None] >= ks_v[None, :]) & (j[:, None] < ke_v[None, :])
                val = tl.where(valid, val, float("-inf"))
            tl.store(out_rows[None, :] + oc[:, None], val,
                     mask=tmask[None, :] & (oc < n_cols)[:, None])
            ksc = ksc_n


def _tma_ready(k: torch.Tensor) -> bool:
    """True when k [S, D] can back a TMA descriptor: 16-byte aligned base and row stride, rows of at
    most 128 bytes (one 128-byte-swizzled box row; wider bf16 rows take the pointer path)."""
    return (k.data_ptr() % 16 == 0 and (k.stride(0) * k.element_size()) % 16 == 0 and k.stride(1) == 1
            and k.shape[0] > 0 and k.shape[1] * k.element_size() <= 128)


def _key_descriptor(k: torch.Tensor, block_s: int):
    """TMA descriptor of k [S, D], block [block_s, D] (rows past S read as zeros)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    return TensorDescriptor.from_tensor(k, [block_s, k.shape[1]])


def _gluon_applies(q: torch.Tensor, k: torch.Tensor) -> bool:
    """The Gluon kernel's domain: Hopper (sm_90) with Gluon importable, fp8 q and k, H in 8/16/32,
    D in 64/128, k rows TMA-ready."""
    if not (q.is_cuda and q.dtype == torch.float8_e4m3fn and k.dtype == torch.float8_e4m3fn
            and q.shape[1] in (8, 16, 32) and q.shape[2] in (64, 128) and _tma_ready(k)):
        return False
    return capability(q) == (9, 0) and gluon_importable()


def supported(q: torch.Tensor, k: torch.Tensor) -> bool:
    """True when the Triton kernel handles these shapes (H in 8/16/32/64, D in 64/128, fp8/bf16)."""
    ok_dtypes = (torch.float8_e4m3fn, torch.bfloat16)
    return (q.shape[1] in SUPPORTED_HEADS and q.shape[2] in SUPPORTED_DIMS and q.dtype in ok_dtypes
            and k.dtype in ok_dtypes and q.stride(2) == 1 and q.stride(1) == q.shape[2] and k.stride(1) == 1)


def work_shape(q: torch.Tensor, k: torch.Tensor, config: LogitsConfig | None = None):
    """The WorkShape (cpkv.kernels.mqa_logits.work) of the kernel that mqa_logits_triton runs for these inputs, or
    None when that kernel takes no work items (not the Gluon kernel)."""
    cfg = config or DEFAULT_CONFIG
    if cfg.variant != "gluon" or not _gluon_applies(q, k):
        return None
    return _gluon_work_shape(q.shape[1], cfg, q.device.index)


def planned_work_shape(heads: int, dim: int, device: torch.device | str, config: LogitsConfig | None = None):
    """work_shape of the fp8 logits call a batch plan will make on ``device`` (q [T, heads, dim], k rows made
    TMA-ready by aligned_keys), known before any tensor exists: the plan builds its work items ahead with it.
    None off CUDA or where the Gluon kernel with work items does not run."""
    device = torch.device(device)
    cfg = config or DEFAULT_CONFIG
    if device.type != "cuda" or cfg.variant != "gluon":
        return None
    if heads not in (8, 16, 32) or dim not in (64, 128):
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if capability(torch.device("cuda", index)) != (9, 0) or not gluon_importable():
        return None
    return _gluon_work_shape(heads, cfg, index)


@functools.lru_cache(maxsize=64)
def _gluon_work_shape(heads: int, cfg: LogitsConfig, device: int | None):
    """work_shape of the Gluon kernel (its domain already checked)."""
    from cpkv.kernels.mqa_logits.work import WorkShape
    from cpkv.kernels.mqa_logits.gluon import BLOCK_S, PROGRAMS_PER_SM, WARPGROUPS

    return WorkShape(rows=128 // heads * WARPGROUPS, tile=BLOCK_S, span=cfg.gluon_span,
                     slots=sm_count(device) * PROGRAMS_PER_SM, split=cfg.gluon_split)


def mqa_logits_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
    out: torch.Tensor,
    *,
    col_offset: int = 0,
    clean: bool = True,
    config: LogitsConfig | None = None,
    work=None,
) -> torch.Tensor:
    """Fill out [T, n_cols] float32 (column c = key col_offset + c); see the module docstring.
    Inputs must already be validated (cpkv.indexer.logits does it). work: None, or a function of a
    WorkShape giving the work items of these rows and columns (IndexerPlan.work_items), used by an
    unclean call of the Gluon kernel."""
    cfg = config or DEFAULT_CONFIG
    T, H, D = q.shape
    n_cols = out.shape[1]
    if T == 0 or n_cols == 0:
        return out
    bq = cfg.bq(H)
    k_align = next(a for a in (16, 8, 4, 2, 1) if k.stride(0) % a == 0)
    grid = logits_grid(n_cols, T, cfg.span * cfg.block_s, bq)
    if cfg.variant == "gluon" and _gluon_applies(q, k):
        from cpkv.kernels.mqa_logits.gluon import mqa_logits_gluon

        use_items = work is not None and not clean
        shape = _gluon_work_shape(H, cfg, q.device.index) if use_items else None
        return mqa_logits_gluon(q, k, k_scale, weights, ks, ke, out, col_offset=col_offset, clean=clean,
                                span=cfg.gluon_span, stages=cfg.gluon_stages, items=work(shape) if shape else None)
    use_tma = cfg.tma and _tma_ready(k)
    extra = {"k_desc": _key_descriptor(k, cfg.block_s) if use_tma else k, "USE_TMA": use_tma}
    mqa_logits_kernel_lanes[grid](
        q, k, k_scale, weights, ks, ke, out,
        T, k.shape[0], col_offset, n_cols,
        q.stride(0), k.stride(0) // k_align, k_scale.stride(0), weights.stride(0), out.stride(0),
        H=H, D=D, BQ=bq, BLOCK_S=cfg.block_s, SPAN=cfg.span, CLEAN=clean,
        CAST_BF16=q.dtype != torch.float8_e4m3fn or k.dtype != torch.float8_e4m3fn,
        K_ALIGN=k_align, num_warps=cfg.num_warps, num_stages=cfg.num_stages, **extra,
        **({"maxnreg": cfg.maxnreg} if cfg.maxnreg else {}),
    )
    return out

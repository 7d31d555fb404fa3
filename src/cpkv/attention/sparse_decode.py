"""Sparse decode MLA over paged fp8 token rows, read where they lie: cpkv's Triton kernel where the backends run
Triton (``cpkv.kernels.sparse_mla.decode``), the torch reference (``sparse_decode_mla_ref``) elsewhere."""
from __future__ import annotations

from typing import Sequence

import torch

from cpkv.attention.checks import INDEX_DTYPES, check_same_device, check_tensor, expect, last_dim_contiguous
from cpkv.config import RowFormat
from cpkv.kernels.platform import Backends, backends_for
from cpkv.kernels.sparse_mla.ref import sparse_decode_mla_ref


def pool_bases(pools: Sequence[torch.Tensor], device: torch.device | str) -> torch.Tensor:
    """int64 [cp] on ``device``: each pool's row-0 address, what the kernel reads (build it once per layer: it is a
    host-to-device copy)."""
    return torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64).to(device)


def sparse_decode_mla(
    q: torch.Tensor, pools: Sequence[torch.Tensor], owner: torch.Tensor, row: torch.Tensor, sm_scale: float,
    d_v: int, fmt: RowFormat, *, bases: torch.Tensor | None = None, backends: Backends | None = None,
    out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q bf16 [B, H, D_L + D_R], pools cp x uint8 [rows, row_bytes] (every rank's token rows of one layer, peers' as
    peer memory maps them), owner / row int [B, K] -> (out bf16 [B, H, d_v], lse float32 [B, H]).

    Generation b attends the dequantised rows ``pools[owner[b, j]][row[b, j]]`` (``fmt``; row < 0: no key) exactly
    as ``sparse_mla`` attends its keys: scores ``sm_scale * q . key`` over all dims, values the first d_v = D_L;
    out 0 and lse +inf for a generation with no key. ``bases``: ``pool_bases(pools, q.device)`` made once (built
    here when None); ``out``: written in place when given. ``backends``: the caller's; None: ``backends_for(q)``."""
    _check(q, pools, owner, row, sm_scale, d_v, fmt, out)
    if not kernel_applies(q, fmt, d_v, backends or backends_for(q)):
        ref_out, lse = sparse_decode_mla_ref(q, pools, owner, row, sm_scale, d_v, fmt)
        if out is None:
            return ref_out.to(torch.bfloat16), lse
        return out.copy_(ref_out), lse
    from cpkv.kernels.sparse_mla import decode as kernel

    if bases is None:
        bases = pool_bases(pools, q.device)
    check_tensor("bases", bases, 1, (torch.int64,))
    if bases.shape[0] != len(pools) or bases.device != q.device:
        expect(False, f"bases int64 [{len(pools)}] on {q.device}", f"shape {tuple(bases.shape)} on {bases.device}")
    return kernel.sparse_decode_mla(last_dim_contiguous(q), bases, last_dim_contiguous(owner),
                                    last_dim_contiguous(row), float(sm_scale), d_v, fmt, out)


def kernel_applies(q: torch.Tensor, fmt: RowFormat, d_v: int, backends: Backends) -> bool:
    """Whether cpkv's kernel runs: a CUDA query, ``backends.triton``, a row format it takes (d_v = D_L)."""
    if not (backends.triton and q.is_cuda):
        return False
    from cpkv.kernels.sparse_mla import decode as kernel

    return kernel.supported(fmt, d_v)


def _check(q: torch.Tensor, pools: Sequence[torch.Tensor], owner: torch.Tensor, row: torch.Tensor, sm_scale: float,
           d_v: int, fmt: RowFormat, out: torch.Tensor | None) -> None:
    """Shapes, dtypes and formats (AttentionError naming what was expected and what came)."""
    check_tensor("q", q, 3, (torch.bfloat16,))
    check_tensor("owner", owner, 2, INDEX_DTYPES)
    check_tensor("row", row, 2, INDEX_DTYPES)
    expect(isinstance(fmt, RowFormat), "an fp8 token row format (cpkv.config.RowFormat)", fmt)
    b, h, d_qk = q.shape
    if d_qk != fmt.fp8_bytes + fmt.rope_dims:
        expect(False, f"q of {fmt.fp8_bytes} + {fmt.rope_dims} dims ({fmt})", f"shape {tuple(q.shape)}")
    if owner.shape != row.shape or row.shape[0] != b:
        expect(False, f"owner and row [{b}, K] (one row per generation)", f"{tuple(owner.shape)}, {tuple(row.shape)}")
    if not (isinstance(d_v, int) and 0 < d_v <= d_qk):
        expect(False, f"0 < d_v <= d_qk = {d_qk}", d_v)
    expect(isinstance(sm_scale, (int, float)) and sm_scale > 0, "a positive float sm_scale", sm_scale)
    expect(len(pools) > 0, "every rank's pool (at least one)", "none")
    for p in pools:
        check_tensor("pool", p, 2, (torch.uint8,))
        if p.shape[1] != fmt.row_bytes or p.stride() != (fmt.row_bytes, 1):
            expect(False, f"pools of contiguous {fmt.row_bytes}-byte rows", f"shape {tuple(p.shape)} strides "
                   f"{p.stride()}")
    if out is not None and (out.shape != (b, h, d_v) or out.dtype != torch.bfloat16 or out.stride(-1) != 1):
        expect(False, f"out bf16 [{b}, {h}, {d_v}], last dim contiguous", f"{out.dtype} {tuple(out.shape)}")
    check_same_device(q=q, owner=owner, row=row)

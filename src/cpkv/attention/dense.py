"""Dense causal MLA: query i attends every kv row in [ks[i], ke[i]) (the short path, no indexer).

Same semantics as ``sparse_mla`` with indices = ks[i] .. ke[i]-1 (rows outside [0, S) ignored; an
empty range gives out 0, lse +inf). On CUDA the kernel derives the indices itself and reads each
row's length on the device, so there is no host sync and no index tensor.
"""
from __future__ import annotations

import torch

from cpkv.attention.checks import INDEX_DTYPES, check_same_device, check_tensor, expect, last_dim_contiguous
from cpkv.attention.sparse import check_inputs, kernel_applies
from cpkv.kernels.platform import Backends, backends_for
from cpkv.kernels.sparse_mla.ref import dense_causal_mla_ref


def dense_causal_mla(
    q: torch.Tensor, kv: torch.Tensor, ks: torch.Tensor, ke: torch.Tensor, sm_scale: float, d_v: int = 512,
    backends: Backends | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q bf16 [T, H, d_qk], kv bf16 [S, d_qk], ks/ke int32 [T] -> (out bf16 [T, H, d_v], lse f32 [T, H]).
    ``backends``: the caller's; None: ``backends_for(q)``."""
    check_inputs(q, kv, sm_scale, d_v)
    t = q.shape[0]
    for name, x in (("ks", ks), ("ke", ke)):
        check_tensor(name, x, 1, INDEX_DTYPES)
        if x.shape[0] != t:
            expect(False, f"{name} of {t} entries (one per query token)", f"shape {tuple(x.shape)}")
    check_same_device(q=q, kv=kv, ks=ks, ke=ke)
    if not kernel_applies(q, d_v, backends or backends_for(q)):
        out, lse = dense_causal_mla_ref(q, kv, ks, ke, sm_scale, d_v)
        return out.to(torch.bfloat16), lse
    from cpkv.kernels.sparse_mla import triton as kernel

    ks32, ke32 = ks.to(torch.int32).contiguous(), ke.to(torch.int32).contiguous()
    out, lse, _ = kernel.launch(last_dim_contiguous(q), last_dim_contiguous(kv), None, ks32, ke32,
                                float(sm_scale), d_v)
    return out, lse

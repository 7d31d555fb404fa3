"""Lightning indexer (docs/design.md §5): fp8 MQA logits, top-k selection, the memory-bounded loop.

    mqa_logits(q, k, k_scale, weights, ks, ke, *, clean=True) -> float32 [T, S]
    topk(logits, ks, ke, k=2048)                              -> int32 [T, k] (relative to ks, -1 pad)
    topk_to_slots(idx, ks)                                    -> int32 [T, k] dense-buffer rows
    index_topk(q, k, k_scale, weights, ks, ke, *, topk=2048, chunk_max_bytes=None, plan=None)
    paged_logits(q, weights, pools, bases, owner_tab, page_tab, slot, ctx, page_size, out) -- decode: one query
        row per generation over its context's index rows read in place (cpkv.indexer.paged; graph-capturable)
    IndexerPlan.build(requests, device, chunk_max_bytes=None) -- once per batch, reused by every layer
    IndexerPlan.work_items(chunk, shape) -- the logits kernel's non-empty programs (cpkv.kernels.mqa_logits.work)
    quantize_index_keys / dequantize_index_rows / quantize_queries -- the 132-byte index rows
    prepare_index_keys / prepare_index_queries -- the same from the projections (norm, RoPE, Hadamard fused)
    head_weights -- the indexer's float32 head weights from the layer's input (no float32 copy of it)

Each entry point takes the caller's ``cpkv.kernels.platform.Backends`` (the model's, chosen once at its load): the
Triton kernels (cpkv.kernels.mqa_logits, cpkv.kernels.topk, cpkv.kernels.index_rows) where they run Triton; the
references beside those kernels (re-exported in cpkv.indexer.ref) run everywhere else and define the edge cases.
"""
from __future__ import annotations

from cpkv.indexer.logits import mqa_logits
from cpkv.indexer.paged import paged_logits
from cpkv.indexer.plan import IndexerChunk, IndexerPlan
from cpkv.indexer.quant import (dequantize_index_keys, dequantize_index_rows, head_weights, prepare_index_keys,
                                prepare_index_queries, quantize_index_keys, quantize_queries)
from cpkv.indexer.ref import mqa_logits_ref, topk_ref
from cpkv.indexer.topk import index_topk, topk, topk_to_slots

__all__ = [
    "IndexerChunk",
    "IndexerPlan",
    "dequantize_index_keys",
    "dequantize_index_rows",
    "head_weights",
    "index_topk",
    "mqa_logits",
    "mqa_logits_ref",
    "paged_logits",
    "prepare_index_keys",
    "prepare_index_queries",
    "quantize_index_keys",
    "quantize_queries",
    "topk",
    "topk_ref",
    "topk_to_slots",
]

"""The pure-torch references of the lightning indexer, kept beside their kernels and re-exported here: the MQA
logits (``cpkv.kernels.mqa_logits.ref``) and the top-k (``cpkv.kernels.topk.ref``, whose docstring states the
contract). They run on any device and define the edge cases the kernels must match."""
from __future__ import annotations

from cpkv.kernels.mqa_logits.ref import mqa_logits_ref
from cpkv.kernels.topk.ref import short_rows_topk, topk_ref

__all__ = ["mqa_logits_ref", "short_rows_topk", "topk_ref"]

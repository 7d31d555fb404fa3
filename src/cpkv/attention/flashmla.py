"""FlashMLA's sparse prefill as a backend of ``cpkv.attention.sparse_mla``: it lives beside cpkv's kernels
(``cpkv.kernels.sparse_mla.flashmla``) and is re-exported here."""
from __future__ import annotations

from cpkv.kernels.sparse_mla.flashmla import D_QK, D_V, HEADS, applies, import_error, load, sparse_fwd

__all__ = ["D_QK", "D_V", "HEADS", "applies", "import_error", "load", "sparse_fwd"]

"""cpkv: context-parallel long-context prefill of DSA models with the KV cache shared across ranks."""
from __future__ import annotations

__version__ = "0.1.0"

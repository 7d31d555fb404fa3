"""Named errors. A user's bad input raises one of these; the message says what was expected and what came."""
from __future__ import annotations


class CpkvError(Exception):
    """Base of every error cpkv raises on bad input or a failed run."""


class ConfigError(CpkvError, ValueError):
    """A configuration value is out of range (page size not a power of two, cp < 1, ...)."""


class LayoutError(CpkvError, ValueError):
    """A batch cannot be laid out (bad lengths, unaligned prefix in a shared batch, ...)."""


class PoolExhausted(CpkvError, RuntimeError):
    """A page allocator has fewer free pages than asked for; its state is unchanged."""


class StagingOverflow(CpkvError, RuntimeError):
    """A batch's current pages exceed the staging capacity (decided from batch data, on every rank)."""


class ComposeError(CpkvError, RuntimeError):
    """Compose misuse: a plan used with another batch, a pool of the wrong row size, an unknown mode."""


class ComposeTimeout(CpkvError, TimeoutError):
    """A barrier timed out; the message names the ranks that never arrived."""


class IndexerError(CpkvError, ValueError):
    """Indexer input that cannot be processed (shapes, a row whose logits cannot fit the chunk budget)."""


class AttentionError(CpkvError, ValueError):
    """Sparse-attention input of the wrong shape or dtype."""


class GemvError(CpkvError, ValueError):
    """fp8 GEMV operands or launch choices outside the kernel's contract (rows, shapes, dtypes, strides)."""


class AdmissionError(CpkvError, ValueError):
    """Scheduler configuration or a request the scheduler can never admit."""


class TraceError(CpkvError, ValueError):
    """A malformed trace line; the message holds its line number and the reason."""


class CheckpointError(CpkvError, ValueError):
    """A checkpoint directory with missing or mis-shaped tensors (named in the message)."""


class RankFailure(CpkvError, RuntimeError):
    """A rank process died or failed; the message names it."""


class PageError(CpkvError, ValueError):
    """A page id that is reserved, out of range, or not held (double free)."""


class NonFiniteError(CpkvError, ArithmeticError):
    """A run produced NaN or Inf logits; the message names the request and where the values first went bad."""

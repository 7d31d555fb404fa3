"""Frozen configuration: model shapes (presets), the CP setup, the cache, the compose modes. No torch import.

Byte layouts derive from the model shape (docs/design.md, byte formats):

    token row  = kv_lora_rank fp8 | kv_lora_rank/128 float32 scales | qk_rope_head_dim bfloat16
                 (GLM-5 / DeepSeek-V3.2: 512 + 16 + 128 = 656 B)
    index row  = index_head_dim fp8 | one float32 scale   (128 + 4 = 132 B)
"""
from __future__ import annotations

from dataclasses import dataclass

from cpkv.errors import ConfigError

QUANT_GROUP = 128
KINDS = ("token", "index")
STRATEGIES = ("zigzag", "contiguous", "round-robin")
DEFAULT_PAGE_SIZE = 64

# The compose modes (cpkv.compose.modes runs them): name -> what it does, in one line. All give byte-identical
# dense buffers; the peer modes fall back to ``fused`` where peer memory is unavailable.
COMPOSE_MODES: dict[str, str] = {
    "legacy": "per request span: own pages (others zero), then a sum all-reduce of the span",
    "fused": "own pages (others zero), then one sum all-reduce of the whole buffer",
    "v2": "peer gather of the prefix pages, then a small all-reduce of the new pages",
    "symm": "writers write into peer-visible staging, a counting barrier, then one gather (no collective)",
    "prefetch": "symm, with the next layer's prefix pages gathered ahead (batches of one request)",
}


@dataclass(frozen=True)
class RowFormat:
    """Byte offsets of one KV row's fields. ``fp8``: values; ``scale``: float32 scales; ``rope``: bfloat16."""

    fp8_bytes: int
    scale_count: int
    rope_dims: int

    @property
    def scale_offset(self) -> int:
        return self.fp8_bytes

    @property
    def rope_offset(self) -> int:
        return self.fp8_bytes + 4 * self.scale_count

    @property
    def row_bytes(self) -> int:
        return self.rope_offset + 2 * self.rope_dims


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a DSA model (MLA attention + lightning indexer + dense MLP)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    intermediate_size: int
    vocab_size: int
    max_context: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    def __post_init__(self) -> None:
        if self.kv_lora_rank % QUANT_GROUP:
            raise ConfigError(f"kv_lora_rank must be a multiple of {QUANT_GROUP}, got {self.kv_lora_rank}")
        for key in ("num_layers", "num_heads", "index_n_heads", "index_head_dim", "index_topk", "max_context"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")

    @property
    def token_format(self) -> RowFormat:
        return RowFormat(self.kv_lora_rank, self.kv_lora_rank // QUANT_GROUP, self.qk_rope_head_dim)

    @property
    def index_format(self) -> RowFormat:
        return RowFormat(self.index_head_dim, 1, 0)

    def row_bytes(self, kind: str) -> int:
        return self.row_format(kind).row_bytes

    def row_format(self, kind: str) -> RowFormat:
        if kind == "token":
            return self.token_format
        if kind == "index":
            return self.index_format
        raise ConfigError(f"unknown KV kind {kind!r}; expected one of {KINDS}")

    @property
    def d_qk(self) -> int:
        """Dims of an absorbed attention score: latent + rope (576 for GLM-5)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


PRESETS: dict[str, ModelConfig] = {
    "glm5": ModelConfig(
        name="glm5", num_layers=78, hidden_size=6144, num_heads=64, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128,
        index_topk=2048, intermediate_size=12288, vocab_size=154880, max_context=202752, rope_theta=1e6,
    ),
    "deepseek-v32": ModelConfig(
        name="deepseek-v32", num_layers=61, hidden_size=7168, num_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
        index_head_dim=128, index_topk=2048, intermediate_size=18432, vocab_size=129280, max_context=163840,
    ),
    "tiny": ModelConfig(
        name="tiny", num_layers=2, hidden_size=128, num_heads=4, q_lora_rank=64, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, index_n_heads=4, index_head_dim=64,
        index_topk=64, intermediate_size=256, vocab_size=512, max_context=65536,
    ),
}


def preset(name: str) -> ModelConfig:
    try:
        return PRESETS[name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}") from None


def is_power_of_two(n: int) -> bool:
    return n >= 1 and (n & (n - 1)) == 0


@dataclass(frozen=True)
class CPConfig:
    """The context-parallel setup: group size, page size, how current pages are split."""

    cp: int = 2
    page_size: int = DEFAULT_PAGE_SIZE
    strategy: str = "zigzag"

    def __post_init__(self) -> None:
        if not isinstance(self.cp, int) or self.cp < 1:
            raise ConfigError(f"cp must be an integer >= 1, got {self.cp!r}")
        if not isinstance(self.page_size, int) or not is_power_of_two(self.page_size):
            raise ConfigError(f"page_size must be a power of two >= 1, got {self.page_size!r}")
        if self.strategy not in STRATEGIES:
            raise ConfigError(f"unknown split strategy {self.strategy!r}; expected one of {', '.join(STRATEGIES)}")


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizes per rank: device pages (page 0 reserved) and pinned-host pages."""

    pages_per_rank: int = 1024
    host_pages: int = 0

    def __post_init__(self) -> None:
        if self.pages_per_rank < 2:
            raise ConfigError(f"pages_per_rank must be >= 2 (page 0 is reserved), got {self.pages_per_rank}")
        if self.host_pages < 0:
            raise ConfigError(f"host_pages must be >= 0, got {self.host_pages}")


@dataclass(frozen=True)
class AdmissionCaps:
    """Caps every rank applies identically when forming a CP batch (docs/design.md, admission).

    ``chunk_size``: the new tokens one batch may compute, which is also the chunk a long prompt is cut into
    (rounded down to whole pages). It bounds one round of current pages, so the compose staging capacity is
    ``staging_pages(page_size)`` = chunk pages + one slack page per request (a request's last page may be
    partial). ``cached_tokens``: carried prefix tokens of a batch; ``buffer_bytes``: its dense buffers,
    staging and indexer logits per rank; ``max_requests``: entries per batch.
    """

    chunk_size: int = 16384
    cached_tokens: int = 1 << 20
    buffer_bytes: int = 64 << 30
    max_requests: int = 16

    def __post_init__(self) -> None:
        for key in ("chunk_size", "cached_tokens", "buffer_bytes", "max_requests"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")

    def effective_extend(self, page_size: int) -> int:
        """The chunk size rounded down to whole pages (at least one page): the extend cap of a batch."""
        cap = self.chunk_size
        return max(page_size, cap - cap % page_size)

    def staging_pages(self, page_size: int) -> int:
        """Current pages one round can hold: extend cap in pages + one slack page per request."""
        return self.effective_extend(page_size) // page_size + self.max_requests

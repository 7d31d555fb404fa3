"""Frozen configuration: model shapes (presets), the CP setup, the cache, the compose modes. No torch import.

Byte layouts derive from the model shape (docs/design.md, byte formats):

    token row  = kv_lora_rank fp8 | kv_lora_rank/128 float32 scales | qk_rope_head_dim bfloat16
                 (GLM-5 / DeepSeek-V3.2: 512 + 16 + 128 = 656 B)
    index row  = index_head_dim fp8 | one float32 scale   (128 + 4 = 132 B), on full indexer layers only

Under ``--precision exact`` (``ModelConfig.kv_dtype`` float32 / bfloat16) both rows hold their values
unquantised in that dtype (``PlainFormat``).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property

from cpkv.errors import ConfigError

QUANT_GROUP = 128
KINDS = ("token", "index")
STRATEGIES = ("zigzag", "contiguous", "round-robin")
DEFAULT_PAGE_SIZE = 64  # tokens per KV page, every command's default
# sparse attention backends (cpkv.attention.sparse, CPKV_SPARSE_MLA; resolved by cpkv.kernels.platform.resolve): FlashMLA where installed (auto), or one
SPARSE_BACKENDS = ("auto", "cpkv", "flashmla")
# the fp8 linears' few-row path (cpkv.kernels.fp8_gemm.gemv; CPKV_FP8_GEMV, resolved by cpkv.kernels.platform.resolve):
# the kernel takes at most FP8_GEMV_MAX_ROWS rows (BM 64); ``auto`` sends it at most FP8_GEMV_AUTO_ROWS: decode's
# batch buckets 1..32, where the product needs 2 M <= 64 FLOPs per weight byte (H200's fp8 ridge is ~400), so a
# kernel that streams the weight once at the copy rate is the floor, and cuBLAS's few-row tiles read it at about half
# that; `cpkv bench gemv` measures where the GEMV stops beating cuBLAS (the threshold to set from it)
FP8_GEMV_CHOICES = ("auto", "on", "off")
FP8_GEMV_MAX_ROWS = 64
FP8_GEMV_AUTO_ROWS = 32

# The compose modes (cpkv.compose.modes runs them): name -> what it does, in one line. All give byte-identical
# dense buffers; the peer modes fall back to ``batch-reduce`` where peer memory is unavailable.
COMPOSE_MODES: dict[str, str] = {
    "span-reduce": "per request span: own pages (others zero), then a sum all-reduce of the span",
    "batch-reduce": "own pages (others zero), then one sum all-reduce of the whole buffer",
    "prefix-gather": "peer gather of the prefix pages, then a small all-reduce of the new pages",
    "symm": "writers write into peer-visible staging, a counting barrier, then one gather (no collective)",
    "prefetch": "symm, with the next layer's prefix pages gathered ahead (batches of one request)",
}
# earlier spellings, still accepted wherever a mode is named (--mode, --modes, CPKV_COMPOSE_MODE, EngineConfig)
COMPOSE_MODE_ALIASES: dict[str, str] = {"legacy": "span-reduce", "fused": "batch-reduce", "v2": "prefix-gather"}


def compose_mode(name: str) -> str:
    """The mode ``name`` spells (an alias becomes its mode's name); any other string comes back unchanged, for
    the caller's check against ``COMPOSE_MODES``."""
    return COMPOSE_MODE_ALIASES.get(name, name) if isinstance(name, str) else name


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
class PlainFormat:
    """An unquantised row (``--precision exact``): ``dims`` values of ``dtype`` (float32 / bfloat16), no scales.

    Token rows hold latent | rope (kv_lora_rank + qk_rope_head_dim values), index rows the indexer key.
    """

    dims: int
    dtype: str

    @property
    def row_bytes(self) -> int:
        return self.dims * DTYPE_BYTES[self.dtype]


KV_DTYPES = ("fp8", "float32", "bfloat16")
DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
INDEXER_TYPES = ("full", "shared")
MLP_TYPES = ("dense", "sparse")
ROPE_STYLES = ("interleaved", "halves")


@dataclass(frozen=True)
class RopeConfig:
    """RoPE of the MLA and indexer rope dims: plain (``default``) or YaRN (``yarn``), as config.json's
    ``rope_parameters`` / ``rope_scaling`` gives it. ``attention_factor`` None: derived from mscale and
    mscale_all_dim (or from ``factor`` alone), as transformers does."""

    theta: float = 10000.0
    type: str = "default"
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 0.0
    mscale_all_dim: float = 0.0
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self) -> None:
        if self.type not in ("default", "yarn"):
            raise ConfigError(f"rope type {self.type!r} is not supported; expected default or yarn")
        if self.type == "yarn" and not (self.factor > 0 and self.original_max_position_embeddings > 0):
            raise ConfigError(f"yarn rope needs factor > 0 and original_max_position_embeddings > 0, got "
                              f"{self.factor} and {self.original_max_position_embeddings}")


@dataclass(frozen=True)
class ModelConfig:
    """Shape of a DSA model: MLA attention, the lightning indexer on ``full`` layers (``shared`` layers reuse
    the previous full layer's top-k and keep no index rows), dense MLPs on the first
    ``first_k_dense_replace`` layers and MoE after them (field names as in the public config.json).

    The indexer pattern is ``indexer_pattern`` when given ("full"/"shared" per layer), else transformers'
    rule: layer i is full when ``max(i - index_skip_topk_offset + 1, 0) % index_topk_freq == 0``. The MLP
    pattern is ``mlp_pattern`` when given ("dense"/"sparse"), else dense before first_k_dense_replace.
    ``kv_dtype``: fp8 (quantised rows) or float32 / bfloat16 (``--precision exact``, unquantised rows).
    """

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
    model_type: str = "deepseek_v32"
    indexer_rope: str = "halves"
    index_topk_freq: int = 1
    index_skip_topk_offset: int = 0
    indexer_pattern: tuple[str, ...] = ()
    first_k_dense_replace: int = 0
    mlp_pattern: tuple[str, ...] = ()
    moe_intermediate_size: int = 0
    n_routed_experts: int = 0
    n_shared_experts: int = 0
    num_experts_per_tok: int = 0
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    rope: RopeConfig | None = None
    kv_dtype: str = "fp8"

    def __post_init__(self) -> None:
        for key in ("num_layers", "num_heads", "index_n_heads", "index_head_dim", "index_topk", "max_context",
                    "index_topk_freq", "n_group", "topk_group"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.kv_dtype not in KV_DTYPES:
            raise ConfigError(f"kv_dtype must be one of {', '.join(KV_DTYPES)}, got {self.kv_dtype!r}")
        if self.indexer_rope not in ROPE_STYLES:
            raise ConfigError(f"indexer_rope must be one of {', '.join(ROPE_STYLES)}, got {self.indexer_rope!r}")
        if self.rope is None:
            object.__setattr__(self, "rope", RopeConfig(theta=self.rope_theta))
        object.__setattr__(self, "rope_theta", self.rope.theta)
        self._check_patterns()
        if "sparse" in self.mlp_layer_types:
            self._check_moe()

    def _check_patterns(self) -> None:
        for key, allowed in (("indexer_pattern", INDEXER_TYPES), ("mlp_pattern", MLP_TYPES)):
            pattern = getattr(self, key)
            if pattern and len(pattern) != self.num_layers:
                raise ConfigError(f"{key} must name all {self.num_layers} layers, got {len(pattern)}")
            bad = sorted({x for x in pattern if x not in allowed})
            if bad:
                raise ConfigError(f"{key}: expected only {' / '.join(allowed)}, got {', '.join(map(repr, bad))}")
        if self.indexer_types[0] != "full":
            raise ConfigError("layer 0 must be a full indexer layer (a shared layer reuses an earlier full layer's "
                              "top-k)")

    def _check_moe(self) -> None:
        for key in ("moe_intermediate_size", "n_routed_experts", "num_experts_per_tok"):
            if getattr(self, key) < 1:
                raise ConfigError(f"MoE layers need {key} >= 1, got {getattr(self, key)}")
        if self.n_routed_experts % self.n_group or self.topk_group > self.n_group:
            raise ConfigError(f"n_routed_experts {self.n_routed_experts} must split into n_group {self.n_group} "
                              f"groups and topk_group {self.topk_group} <= n_group")
        per_group = self.n_routed_experts // self.n_group
        if per_group < 2 or self.num_experts_per_tok > self.topk_group * per_group:
            raise ConfigError(f"grouped routing needs >= 2 experts per group and num_experts_per_tok "
                              f"{self.num_experts_per_tok} <= topk_group x experts per group")

    # -- per-layer kinds ---------------------------------------------------------------------------
    @cached_property
    def indexer_types(self) -> tuple[str, ...]:
        """"full" / "shared" per layer (class docstring)."""
        if self.indexer_pattern:
            return self.indexer_pattern
        f, o = self.index_topk_freq, self.index_skip_topk_offset
        return tuple("full" if max(i - o + 1, 0) % f == 0 else "shared" for i in range(self.num_layers))

    @cached_property
    def mlp_layer_types(self) -> tuple[str, ...]:
        """"dense" / "sparse" (MoE) per layer."""
        if self.mlp_pattern:
            return self.mlp_pattern
        n = min(self.first_k_dense_replace, self.num_layers)
        return ("dense",) * n + ("sparse",) * (self.num_layers - n)

    @cached_property
    def full_layers(self) -> tuple[int, ...]:
        """Layers that run the indexer and keep index rows."""
        return tuple(i for i, t in enumerate(self.indexer_types) if t == "full")

    def kinds_at(self, layer: int) -> tuple[str, ...]:
        """KV kinds layer ``layer`` writes and composes: token and index on full layers, token on shared ones."""
        return KINDS if self.indexer_types[layer] == "full" else KINDS[:1]

    def layers_of(self, kind: str) -> tuple[int, ...]:
        """Layers holding rows of ``kind`` (every layer for token rows, the full layers for index rows)."""
        self.row_format(kind)  # validates the kind
        return tuple(range(self.num_layers)) if kind == "token" else self.full_layers

    def kv_bytes_per_token(self) -> int:
        """Pool bytes one cached token takes over all layers: token rows everywhere, index rows on full layers."""
        return sum(len(self.layers_of(k)) * self.row_bytes(k) for k in KINDS)

    def with_layers(self, num_layers: int) -> "ModelConfig":
        """The first ``num_layers`` layers (benchmarks, tests); an explicit pattern is cut, not extended."""
        for key in ("indexer_pattern", "mlp_pattern"):
            if getattr(self, key) and num_layers > len(getattr(self, key)):
                raise ConfigError(f"num_layers {num_layers}: the model's {key} names only {len(getattr(self, key))}")
        return dataclasses.replace(self, num_layers=num_layers, indexer_pattern=self.indexer_pattern[:num_layers],
                                   mlp_pattern=self.mlp_pattern[:num_layers])

    def with_experts(self, n: int) -> "ModelConfig":
        """The same model routing over ``n`` routed experts per MoE layer instead of ``n_routed_experts``: one
        rank's share at cp ``n_routed_experts / n`` on one GPU. Every dimension and the depth stay; the router's
        weight and correction bias get ``n`` rows; the grouping stays (``n`` must split into ``n_group`` groups of
        >= 2 experts with ``num_experts_per_tok`` <= ``topk_group`` x experts per group), so each token still picks
        ``num_experts_per_tok`` experts and its expert FLOPs are unchanged; the chosen experts' weights are
        normalised (``norm_topk_prob``) and scaled as before, so the combine is defined as at the full count."""
        if "sparse" not in self.mlp_layer_types:
            raise ConfigError(f"--experts {n}: {self.name} has no MoE layer")
        if not isinstance(n, int) or not self.num_experts_per_tok <= n <= self.n_routed_experts:
            raise ConfigError(f"--experts must be an integer in {self.num_experts_per_tok}..{self.n_routed_experts} "
                              f"(at least the {self.num_experts_per_tok} experts each token picks, at most the "
                              f"model's), got {n!r}")
        per = self.n_routed_experts // self.n_group
        if n % self.n_group or n // self.n_group < 2 or self.num_experts_per_tok > self.topk_group * (n // self.n_group):
            fits = [k for k in range(self.num_experts_per_tok, self.n_routed_experts + 1) if k % self.n_group == 0
                    and k // self.n_group >= 2 and self.num_experts_per_tok <= self.topk_group * (k // self.n_group)]
            raise ConfigError(f"--experts {n}: {self.name} routes in {self.n_group} groups of {per} (top "
                              f"{self.topk_group} groups, {self.num_experts_per_tok} experts a token); expected a "
                              f"multiple of {self.n_group} from {fits[0]} to {self.n_routed_experts}")
        return dataclasses.replace(self, n_routed_experts=n)

    # -- row formats -------------------------------------------------------------------------------
    @property
    def token_format(self) -> RowFormat | PlainFormat:
        if self.kv_dtype != "fp8":
            return PlainFormat(self.kv_lora_rank + self.qk_rope_head_dim, self.kv_dtype)
        if self.kv_lora_rank % QUANT_GROUP:
            raise ConfigError(f"fp8 token rows need kv_lora_rank in whole groups of {QUANT_GROUP}, got "
                              f"{self.kv_lora_rank} (use --precision exact)")
        return RowFormat(self.kv_lora_rank, self.kv_lora_rank // QUANT_GROUP, self.qk_rope_head_dim)

    @property
    def index_format(self) -> RowFormat | PlainFormat:
        if self.kv_dtype != "fp8":
            return PlainFormat(self.index_head_dim, self.kv_dtype)
        return RowFormat(self.index_head_dim, 1, 0)

    def row_bytes(self, kind: str) -> int:
        return self.row_format(kind).row_bytes

    def row_format(self, kind: str) -> RowFormat | PlainFormat:
        if kind == "token":
            return self.token_format
        if kind == "index":
            return self.index_format
        raise ConfigError(f"unknown KV kind {kind!r}; expected one of {KINDS}")

    @property
    def d_qk(self) -> int:
        """Dims of an absorbed attention score: latent + rope (576 for GLM-5)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


PRESET_PREFIX = "preset:"  # --model preset:glm5 (model_source)
PRESETS: dict[str, ModelConfig] = {
    # zai-org/GLM-5 config.json: 78 layers, indexer on 40 of them (index_topk_freq 2, offset 2), MoE from layer 3
    "glm5": ModelConfig(
        name="glm5", num_layers=78, hidden_size=6144, num_heads=64, q_lora_rank=2048, kv_lora_rank=512,
        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_n_heads=32, index_head_dim=128,
        index_topk=2048, intermediate_size=12288, vocab_size=154880, max_context=202752, rope_theta=1e6,
        rms_norm_eps=1e-5, model_type="glm_moe_dsa", indexer_rope="interleaved", index_topk_freq=2,
        index_skip_topk_offset=2, first_k_dense_replace=3, moe_intermediate_size=2048, n_routed_experts=256,
        n_shared_experts=1, num_experts_per_tok=8, n_group=1, topk_group=1, routed_scaling_factor=2.5,
    ),
    # deepseek-ai/DeepSeek-V3.2 config.json: indexer on every layer, YaRN x40 from 4096 positions
    "deepseek-v32": ModelConfig(
        name="deepseek-v32", num_layers=61, hidden_size=7168, num_heads=128, q_lora_rank=1536,
        kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, index_n_heads=64,
        index_head_dim=128, index_topk=2048, intermediate_size=18432, vocab_size=129280, max_context=163840,
        model_type="deepseek_v32", indexer_rope="halves", first_k_dense_replace=3, moe_intermediate_size=2048,
        n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8, n_group=8, topk_group=4,
        routed_scaling_factor=2.5,
        rope=RopeConfig(theta=10000.0, type="yarn", factor=40.0, original_max_position_embeddings=4096,
                        mscale=1.0, mscale_all_dim=1.0),
    ),
    # GLM-5's structure at toy sizes: full / shared / full indexer layers, a dense layer then MoE layers; 24
    # routed experts, so that expert parallelism runs at cp 1, 2, 3, 4, 6 and 8
    "tiny": ModelConfig(
        name="tiny", num_layers=3, hidden_size=128, num_heads=4, q_lora_rank=64, kv_lora_rank=128,
        qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, index_n_heads=4, index_head_dim=64,
        index_topk=64, intermediate_size=256, vocab_size=512, max_context=65536, model_type="glm_moe_dsa",
        indexer_rope="interleaved", index_topk_freq=2, index_skip_topk_offset=1, first_k_dense_replace=1,
        moe_intermediate_size=64, n_routed_experts=24, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
        topk_group=1, routed_scaling_factor=2.5,
    ),
}


def preset(name: str) -> ModelConfig:
    """The preset ``name`` (``glm5`` or ``preset:glm5``)."""
    try:
        return PRESETS[name[len(PRESET_PREFIX):] if name.startswith(PRESET_PREFIX) else name]
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; expected one of {', '.join(PRESETS)}") from None


def model_source(spec: str) -> tuple[str, str]:
    """Where ``--model spec`` comes from: ("preset", name) or ("dir", path). ``preset:NAME`` names a preset;
    a plain preset name is one only while no directory of that name exists (ConfigError naming both when
    one does: a folder in the working directory must never silently change what the ranks load); anything
    else is a checkpoint directory."""
    if spec.startswith(PRESET_PREFIX):
        name = spec[len(PRESET_PREFIX):]
        preset(name)  # ConfigError listing the presets
        return "preset", name
    if spec in PRESETS:
        import os

        if os.path.isdir(spec):
            raise ConfigError(f"--model {spec!r} names both the preset {spec} and the directory "
                              f"{os.path.abspath(spec)!r}: write --model {PRESET_PREFIX}{spec} for the preset or "
                              f"--model ./{spec} for the directory")
        return "preset", spec
    return "dir", spec


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
class Sizes:
    """The batch and pool sizes a command starts from, each overridden by its own flag: ``chunk_size`` (new tokens
    per batch, and the chunk a long prompt is cut into), ``max_requests`` (entries per batch), ``pages_per_rank``
    (each rank's device pool, page 0 reserved), ``cp`` (the CP group's ranks). Every command names the preset it
    starts from (``SIZES``)."""

    chunk_size: int
    max_requests: int
    pages_per_rank: int
    cp: int


# The named size presets. "model": a real model on an 8-GPU node (``cpkv plan``, ``cpkv replay``, the memory plan,
# the admission caps); "toy": the tiny preset on a CPU, where a 512-token chunk already cuts the built-in trace's
# prompts and two ranks show the shared KV (``cpkv run``, ``cpkv serve``, ``cpkv bench serve``, ``EngineConfig``,
# ``cpkv bench compose`` / ``check compose``). ``cpkv bench engine`` measures one GPU: its cp is 1 unless told.
SIZES: dict[str, Sizes] = {
    "model": Sizes(chunk_size=16384, max_requests=16, pages_per_rank=1024, cp=8),
    "toy": Sizes(chunk_size=512, max_requests=8, pages_per_rank=256, cp=2),
}
MODEL_SIZES, TOY_SIZES = SIZES["model"], SIZES["toy"]


def check_batch_sizes(page_size: int, chunk_size: int, max_requests: int) -> None:
    """``chunk_size`` and ``max_requests`` integers >= 1, ``chunk_size`` a multiple of ``page_size`` (the one check
    every config runs; ConfigError naming the fields, which ``cli.args.as_flags`` turns into flags)."""
    for key, value in (("chunk_size", chunk_size), ("max_requests", max_requests)):
        if not isinstance(value, int) or value < 1:
            raise ConfigError(f"{key} must be an integer >= 1, got {value!r}")
    if chunk_size % page_size:
        raise ConfigError(f"chunk_size {chunk_size} must be a multiple of page_size {page_size}")


def pool_caps(cp: int, page_size: int, pages_per_rank: int, chunk_size: int, max_requests: int) -> "AdmissionCaps":
    """The engine's admission caps over ``cp`` pools of ``pages_per_rank`` pages: the chunk is the cap on new tokens, the
    cached cap is every pool's pages (page 0 reserved), the buffers' cap is generous (the memory plan sizes
    them)."""
    return AdmissionCaps(chunk_size=chunk_size, cached_tokens=max(1, (pages_per_rank - 1) * cp * page_size),
                         buffer_bytes=64 << 30, max_requests=max_requests)


@dataclass(frozen=True)
class CacheConfig:
    """KV cache sizes per rank: device pages (page 0 reserved) and pinned-host pages."""

    pages_per_rank: int = MODEL_SIZES.pages_per_rank
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

    chunk_size: int = MODEL_SIZES.chunk_size
    cached_tokens: int = 1 << 20
    buffer_bytes: int = 64 << 30
    max_requests: int = MODEL_SIZES.max_requests

    def __post_init__(self) -> None:
        for key in ("chunk_size", "cached_tokens", "buffer_bytes", "max_requests"):
            if getattr(self, key) < 1:
                raise ConfigError(f"{key} must be >= 1, got {getattr(self, key)}")

    def chunk_tokens(self, page_size: int) -> int:
        """``chunk_size`` in whole pages (at least one page): the new tokens one batch may compute. Equal to
        ``chunk_size`` wherever the commands built the caps (``check_batch_sizes`` asks a multiple of the page)."""
        cap = self.chunk_size
        return max(page_size, cap - cap % page_size)

    def staging_pages(self, page_size: int) -> int:
        """Current pages one round can hold: chunk in pages + one slack page per request."""
        return self.chunk_tokens(page_size) // page_size + self.max_requests

    def max_slots(self, page_size: int) -> int:
        """Logical pages of the largest batch the caps admit: every cached page, one partial page per
        request, one round of current pages (the dense-buffer arena is sized for it)."""
        return self.cached_tokens // page_size + self.max_requests + self.staging_pages(page_size)

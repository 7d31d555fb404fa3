"""What one engine run is: model, CP group, cache, admission. No torch import."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from cpkv.config import (COMPOSE_MODES, DEFAULT_PAGE_SIZE, TOY_SIZES, AdmissionCaps, CacheConfig, CPConfig,
                         check_batch_sizes, compose_mode, pool_caps)
from cpkv.errors import ConfigError

if TYPE_CHECKING:
    from cpkv.config import ModelConfig

MODES = tuple(COMPOSE_MODES)
PRECISIONS = ("fp8", "exact")
REFERENCES = ("parent", "rank")  # cpkv.engine.verify: where the verification's reference model runs
WEIGHTS = ("auto", "fp8", "bf16")  # auto: fp8 when the checkpoint ships fp8 block-scaled weights (CUDA, fp8 precision)
DECODES = ("paged", "extend")  # how the online engine advances a generation (docs/design.md §11)
GRAPH_TOKENS = 1024  # the commands' graph_tokens on CUDA unless told (cpkv.engine.graphs; BENCHMARKS.md)


def default_graph_tokens(device: str, asked: int | None, precision: str = "fp8") -> int:
    """``asked``, else GRAPH_TOKENS on CUDA at fp8 precision and 0 otherwise (off CUDA the graphs' buffers only add
    copies; ``--precision exact``, a checking mode whose torch paths were not run under capture, stays eager
    unless asked)."""
    if asked is not None:
        return asked
    return GRAPH_TOKENS if device == "cuda" and precision == "fp8" else 0


def is_preset(model: str) -> bool:
    """``model`` selects a preset (``preset:NAME``, or a plain preset name no directory shadows)."""
    from cpkv.config import model_source
    return model_source(model)[0] == "preset"


@dataclass(frozen=True)
class EngineConfig:
    """One run of the CP prefill engine.

    ``model``: a preset name or a checkpoint directory; ``seed``: random weights of a preset.
    ``pages_per_rank`` (page 0 reserved) and ``host_pages`` size each rank's device pool and host tier.
    ``chunk_size`` and ``max_requests`` are the admission caps that matter at toy sizes; the cached cap
    is what all pools hold. ``mode`` ``prefetch`` runs batches of one request. The sizes start from the "toy"
    preset (``cpkv.config.SIZES``), as ``cpkv run`` and ``cpkv serve`` do.
    """

    model: str = "tiny"
    seed: int = 0
    num_layers: int | None = None
    experts: int | None = None  # routed experts per MoE layer (ModelConfig.with_experts: one rank's share on one
    #                             GPU); None: the model's
    cp: int = TOY_SIZES.cp
    mode: str = "symm"
    device: str = "cpu"
    page_size: int = DEFAULT_PAGE_SIZE
    strategy: str = "zigzag"
    pages_per_rank: int = TOY_SIZES.pages_per_rank
    host_pages: int = 0
    policy: str = "solo"
    chunk_size: int = TOY_SIZES.chunk_size
    max_requests: int = TOY_SIZES.max_requests
    full_hit: str = "page"
    precision: str = "fp8"  # fp8 KV rows, or exact: rows, indexer keys and queries in the model dtype
    weights: str = "auto"  # linear weights kept fp8 (block-scaled GEMMs) or widened to the compute dtype (WEIGHTS)
    graph_tokens: int = 0  # a rank's batches of up to this many tokens run each layer's token-only pieces as CUDA
    #                        graphs, one per token bucket (cpkv.engine.graphs); 0: off. On CPU: the same
    #                        buffers and padding, run eagerly
    warmup: bool = False  # replay the trace once untimed first (JIT-compiles/autotunes the GPU kernels)
    record: bool = False  # record the layers' discrete decisions (experts, indexer selections) for verification
    look_ahead: bool = True  # form and plan the next batch while the GPU runs this one (engine.executor)
    chain: bool = True       # launch a batch planned ahead without waiting for the one before (engine.executor)
    reference: str = "parent"  # where verification's reference runs (REFERENCES): a second model in the parent
    #                            process, or (cp 1) rank 0's own model after its run, sharing the engine's weights
    decode: str = "paged"    # the online engine's decode steps: "paged" (one batched step of every generation over
    #                          the KV where it lies, cpkv.engine.decode) or "extend" (a one-token prefill per step)

    def __post_init__(self) -> None:
        """Validate every field before any rank process starts (ranks only ever see valid configs)."""
        from cpkv.scheduler.admission import POLICIES

        if compose_mode(self.mode) not in MODES:
            raise ConfigError(f"unknown compose mode {self.mode!r}; expected one of {', '.join(MODES)}")
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"unknown admission policy {self.policy!r}; expected one of {', '.join(POLICIES)}")
        CPConfig(self.cp, self.page_size, self.strategy)  # validates
        CacheConfig(self.pages_per_rank, self.host_pages)  # validates
        if not isinstance(self.graph_tokens, int) or not 0 <= self.graph_tokens <= 1 << 16:
            raise ConfigError(f"graph_tokens must be an integer in 0..65536, got {self.graph_tokens!r}")
        check_batch_sizes(self.page_size, self.chunk_size, self.max_requests)
        if self.num_layers is not None and self.num_layers < 1:
            raise ConfigError(f"num_layers must be >= 1, got {self.num_layers}")
        if self.weights not in WEIGHTS:
            raise ConfigError(f"weights must be one of {', '.join(WEIGHTS)}, got {self.weights!r}")
        if self.decode not in DECODES:
            raise ConfigError(f"decode must be one of {', '.join(DECODES)}, got {self.decode!r}")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.reference not in REFERENCES:
            raise ConfigError(f"reference must be one of {', '.join(REFERENCES)}, got {self.reference!r}")
        if self.reference == "rank" and self.cp != 1:
            raise ConfigError(f"reference 'rank' needs cp 1 (rank 0 holding every expert), got cp {self.cp}: at cp > 1 "
                              "the reference runs in the parent process")
        cfg = self.model_config()  # a preset, or a directory with a valid config.json (the ranks' config)
        if "sparse" in cfg.mlp_layer_types and cfg.n_routed_experts % self.cp:
            raise ConfigError(f"cp {self.cp} must divide the model's {cfg.n_routed_experts} routed experts (each "
                              f"rank holds n_routed_experts / cp of them)")
        cfg.token_format  # noqa: B018 -- fp8 rows need kv_lora_rank in whole 128-value groups
        if not is_preset(self.model):
            from cpkv.model.checkpoint import check_checkpoint
            check_checkpoint(self.model, cfg)  # every header, name and shape, before any rank starts

    def model_config(self) -> "ModelConfig":
        """The model config every rank runs: the preset or config.json, cut to ``num_layers``, with the KV dtype
        of ``precision`` on ``device``. The parent process uses this one (never a config without the precision)."""
        from cpkv.model.config import COMPUTE_DTYPES, load_model_config, with_precision

        return with_precision(load_model_config(self.model, self.num_layers, self.experts), self.precision,
                              COMPUTE_DTYPES[self.device])

    @property
    def weights_dtype(self) -> str:
        """``weights`` resolved: "fp8" (linear weights kept block-scaled fp8) or "bf16" (the compute dtype)."""
        from cpkv.model.config import resolve_weights
        return resolve_weights(self.weights, self.model, self.device, self.precision)

    @property
    def cp_config(self) -> CPConfig:
        return CPConfig(self.cp, self.page_size, self.strategy)

    def caps(self) -> AdmissionCaps:
        """Admission caps: chunk = the cap on new tokens; cached cap = every pool's pages; prefetch runs solo."""
        return pool_caps(self.cp, self.page_size, self.pages_per_rank, self.chunk_size,
                         1 if self.mode == "prefetch" else self.max_requests)

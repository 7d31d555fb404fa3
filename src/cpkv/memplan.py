"""The memory plan: how many bytes each thing of a cpkv run takes on one rank, and how many KV tokens the
rest holds (docs/design.md §10). No torch import: ``cpkv plan`` and ``cpkv run``'s pre-check run it before
anything loads.

    setup = Setup(model, cp=8, weights="fp8", budget=141 * GB)     # model: precision applied
    plan = plan_memory(setup)           # pages_per_rank None: the largest pool that fits the budget
    plan.items                          # per rank: weights, experts, kv, staging, compose, logits, activations, workspace
    plan.kv_tokens, plan.fits, plan.largest()

Per rank (one GPU per rank; ranks sharing a device divide its budget):

- ``weights``: everything but the routed experts, replicated on every rank: attention, indexer, dense MLPs,
  shared experts, router, norms, embeddings and head. Linear weights (``is_fp8_linear``) take 1 B per value
  plus a float32 scale per 128 x 128 block when kept fp8, else the compute dtype (bf16 on CUDA, float32 on
  CPU); the rest the compute dtype, the two kept float32 (``FLOAT32_WEIGHTS``) 4 B. Plus the absorbed MLA
  copies W_UK / W_UV every layer keeps in the compute dtype beside kv_b_proj.
- ``experts``: ceil(n_routed / shards) experts of every MoE layer (shards = cp when cp divides the expert
  count: expert parallelism; else every rank holds them all).
- ``kv``: the pool, pages x page_size x ``ModelConfig.kv_bytes_per_token`` (page 0 reserved).
- ``staging``, ``compose`` (the dense-buffer arena: dense buffers and compact scratch, both kinds, two
  parity halves, for the largest batch the caps admit) and ``logits`` (one indexer logits chunk): the
  admission's byte model (``scheduler.admission.Admission``), so the plan and admission agree.
- ``activations``: the tensors live at a layer's peak on the busiest rank (``activation_parts``).
- ``workspace``: CUDA context and libraries + allocator slack (``WORKSPACE``), or a CPU process's share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import lru_cache

from cpkv.config import (DEFAULT_PAGE_SIZE, KINDS, MODEL_SIZES, AdmissionCaps, CPConfig, ModelConfig, check_batch_sizes,
                         pool_caps)
from cpkv.errors import ConfigError
from cpkv.model.checkpoint import fp8_kept, fp8_scale_shape, layer_kinds, layer_shapes, outer_shapes
from cpkv.scheduler.admission import Admission

MAX_ADVISED_CP = 4096  # the largest --cp an advice names (cpkv plan's bound)
GB = 10**9  # --gpu-memory and the tables count decimal GB, as GPU memory is sold (an H200: 141 GB)
GIB = 1 << 30
DTYPE_BYTES = {"fp8": 1, "bfloat16": 2, "float32": 4}
WEIGHTS = ("fp8", "bf16")  # linear weights kept fp8, or widened to the compute dtype ("bf16": bf16 on CUDA)
FLOAT32_WEIGHTS = ("e_score_correction_bias", "indexer.weights_proj.weight")  # = cpkv.model.model's
ARENA_SLACK = 2 * 2 * 2 * 256  # halves x kinds x (dense, compact) x the arena's 256-byte alignment
# Other workspace per rank, beside what the plan counts tensor by tensor:
# CUDA: 2 GiB for the CUDA context (~0.6 GiB with lazy module loading), cuBLAS / cuBLASLt workspaces, NCCL's
# channel buffers for up to 7 peers (~0.5 GiB), the loaded Triton / Gluon kernel images and the small per-batch
# plans; plus 10 % of the transient tensors (activations, logits chunk) for the caching allocator's rounding and
# fragmentation (weights, pool, staging and arena are single allocations made once, which do not fragment).
# CPU: 384 MiB per rank process (the interpreter with torch imported, libtorch's private pages, gloo).
WORKSPACE = {"cuda": (2 * GIB, 0.10), "cpu": (384 << 20, 0.0)}
# The CUDA graphs' memory beyond their tensors: torch's caching allocator takes memory in segments (20 MiB at least for
# a block over 1 MiB, 2 MiB for smaller ones), and the graphs use two pools (the default one for the buffers made at
# a piece's first run, their own for the captures): one partly used segment of each size in each (BENCHMARKS.md
# has the measurement behind it).
GRAPH_SEGMENT_SLACK = 2 * ((20 << 20) + (2 << 20))

# (key, label, what shrinks it) in table order; the JSON's per_rank keys are these names
ITEMS = (
    ("weights_bytes", "replicated weights", "lower --num-layers"),
    ("expert_bytes", "expert shard", "change --cp to a divisor of the routed experts, or --num-layers"),
    ("kv_bytes", "KV pool", "lower --pages-per-rank"),
    ("staging_bytes", "staging", "lower --chunk-size or --max-requests"),
    ("compose_bytes", "dense compose buffers", "lower --pages-per-rank or --chunk-size"),
    ("logits_bytes", "indexer logits chunk", "lower CPKV_MQA_LOGITS_CHUNK_MAX_GB or --chunk-size"),
    ("activation_bytes", "activations at the chunk size", "lower --chunk-size"),
    ("graph_bytes", "CUDA graph buffers and pool", "lower --graph-tokens (0: no graphs)"),
    ("decision_bytes", "recorded decisions (verification)", "lower --chunk-size, or --no-verify"),
    ("workspace_bytes", "other workspace", "a fixed cost per rank: give each rank more memory"),
)


def is_fp8_linear(name: str, shape: tuple[int, ...]) -> bool:
    """A linear weight the model keeps as float8 + 128 x 128 block scales under fp8 weights: the loader's own rule
    (``model.checkpoint.fp8_kept``): every 2-D projection of attention, indexer and MLPs (dense, shared, routed) but
    kv_b_proj (kept in the compute dtype beside its W_UK / W_UV split); not embeddings, head, router or indexer head
    weights."""
    return len(shape) == 2 and fp8_kept(name)


def tensor_bytes(name: str, shape: tuple[int, ...], weights: str, compute: str) -> int:
    """Bytes one weight takes on the device (``weights``: WEIGHTS; ``compute``: the model dtype)."""
    n = math.prod(shape)
    if weights == "fp8" and is_fp8_linear(name, shape):
        return n + 4 * math.prod(fp8_scale_shape(shape))
    return n * (4 if name.endswith(FLOAT32_WEIGHTS) else DTYPE_BYTES[compute])


@dataclass(frozen=True)
class WeightBytes:
    """A model's weights on one device: ``params`` (values), ``replicated`` bytes (everything but the routed
    experts, absorbed copies included), ``expert`` bytes of one routed expert in one MoE layer, ``moe_layers``."""

    params: int
    replicated: int
    expert: int
    moe_layers: int


@lru_cache(maxsize=64)
def weight_bytes(model: ModelConfig, weights: str, compute: str) -> WeightBytes:
    """Bytes of ``model``'s tensors (``model.checkpoint.expected_shapes``) stored as ``weights`` / ``compute``,
    counted once per layer kind (``layer_kinds``): any depth takes the same few milliseconds."""
    if weights not in WEIGHTS:
        raise ConfigError(f"weights must be one of {', '.join(WEIGHTS)}, got {weights!r}")
    params = sum(math.prod(shape) for shape in outer_shapes(model).values())
    replicated = sum(tensor_bytes(name, shape, weights, compute) for name, shape in outer_shapes(model).items())
    expert = 0
    for n, layers in layer_kinds(model).items():
        p, r, e = _layer_bytes(model, n, weights, compute)
        params, replicated = params + layers * p, replicated + layers * r
        expert = expert or e  # one routed expert of one MoE layer: every expert has its shapes
    h, nope, v, kr = model.num_heads, model.qk_nope_head_dim, model.v_head_dim, model.kv_lora_rank
    replicated += model.num_layers * h * (nope + v) * kr * DTYPE_BYTES[compute]  # W_UK, W_UV (layer.py)
    return WeightBytes(params, replicated, expert, model.mlp_layer_types.count("sparse"))


def _layer_bytes(model: ModelConfig, n: int, weights: str, compute: str) -> tuple[int, int, int]:
    """Layer ``n``'s (parameters, replicated bytes, bytes of its routed expert 0: 0 in a dense layer)."""
    params = replicated = expert = 0
    for key, shape in layer_shapes(model, n).items():
        name = f"model.layers.{n}.{key}"
        params += math.prod(shape)
        if ".mlp.experts." not in name:
            replicated += tensor_bytes(name, shape, weights, compute)
        elif key.startswith("mlp.experts.0."):
            expert += tensor_bytes(name, shape, weights, compute)
    return params, replicated, expert


WEIGHT_PARTS = ("embedding", "lm_head", "norms", "attention", "mla_absorbed", "indexer", "router", "dense_mlp",
                "shared_experts", "experts")


def weight_part(name: str) -> str:
    """The ``WEIGHT_PARTS`` category of a checkpoint tensor (``benchmarks/plan_breakdown.py`` counts the model by them)."""
    if name == "model.embed_tokens.weight":
        return "embedding"
    if name == "lm_head.weight":
        return "lm_head"
    if ".mlp.experts." in name:
        return "experts"
    if "kv_b_proj" in name:
        return "mla_absorbed"
    if ".indexer." in name:
        return "indexer"
    if ".self_attn." in name and not name.endswith("layernorm.weight"):
        return "attention"
    if ".mlp.gate." in name:
        return "router"
    if ".shared_experts." in name:
        return "shared_experts"
    if ".mlp." in name:
        return "dense_mlp"
    return "norms"


def weight_parts(model: ModelConfig, weights: str, compute: str, experts_per_rank: int) -> dict[str, int]:
    """``weight_bytes`` split by ``WEIGHT_PARTS`` (the routed experts: ``experts_per_rank`` of every MoE layer)."""
    out = dict.fromkeys(WEIGHT_PARTS, 0)
    for name, shape in outer_shapes(model).items():
        out[weight_part(name)] += tensor_bytes(name, shape, weights, compute)
    for n, layers in layer_kinds(model).items():
        for key, shape in layer_shapes(model, n).items():
            name = f"model.layers.{n}.{key}"
            if ".mlp.experts." in name and not key.startswith("mlp.experts.0."):
                continue
            b = tensor_bytes(name, shape, weights, compute) * layers
            out[weight_part(name)] += b * (experts_per_rank if ".mlp.experts." in name else 1)
    h, nope, v, kr = model.num_heads, model.qk_nope_head_dim, model.v_head_dim, model.kv_lora_rank
    out["mla_absorbed"] += model.num_layers * h * (nope + v) * kr * DTYPE_BYTES[compute]
    return out


SHIPPED_FP8 = ("glm5", "deepseek-v32")  # presets whose public checkpoints ship fp8 block-scaled weights


def ships_fp8(spec: str) -> bool:
    """Whether the model ``spec`` names ships fp8 block-scaled linear weights: the glm5 / deepseek-v32
    presets (GLM-5-FP8, DeepSeek-V3.2 as published), or a checkpoint dir whose config.json declares them
    (``model.config.fp8_block_checkpoint``, the rule ``--weights auto`` uses)."""
    from cpkv.model.config import fp8_block_checkpoint

    return spec in SHIPPED_FP8 or fp8_block_checkpoint(spec)


def default_weights(spec: str) -> str:
    """``cpkv plan``'s weights: as the model ships them."""
    return "fp8" if ships_fp8(spec) else "bf16"


@dataclass(frozen=True)
class Setup:
    """What is planned: ``model`` with its precision applied (its row formats are the pool's), the CP group,
    how weights are kept (``weights``: WEIGHTS; ``compute``: the model dtype), the engine's admission options,
    the pool (``pages_per_rank`` None: the largest that fits) and the ``budget`` in bytes per rank.
    ``host_pages`` counts only on CPU, where the host tier shares the budget."""

    model: ModelConfig
    cp: int
    budget: int
    weights: str = "fp8"
    compute: str = "bfloat16"
    device: str = "cuda"
    page_size: int = DEFAULT_PAGE_SIZE
    chunk_size: int = MODEL_SIZES.chunk_size
    max_requests: int = MODEL_SIZES.max_requests
    pages_per_rank: int | None = None
    host_pages: int = 0
    logits_budget: int | None = None
    graph_tokens: int = 0  # the engine's graph_tokens (cpkv.engine.graphs): 0, no graphs
    record: bool = False  # the run records its decisions for verification (EngineConfig.record): decision_bytes

    def __post_init__(self) -> None:
        CPConfig(self.cp, self.page_size)  # validates
        check_batch_sizes(self.page_size, self.chunk_size, self.max_requests)
        if self.device not in WORKSPACE or self.compute not in ("bfloat16", "float32"):
            raise ConfigError(f"device must be cuda or cpu and compute bfloat16 or float32, got {self.device!r} "
                              f"and {self.compute!r}")
        if self.pages_per_rank is not None and self.pages_per_rank < 2:
            raise ConfigError(f"pages_per_rank must be >= 2 (page 0 is reserved), got {self.pages_per_rank}")

    @property
    def expert_shards(self) -> int:
        """Ranks the routed experts split over: cp when it divides the expert count, else 1 (all on every rank)."""
        e = self.model.n_routed_experts
        return self.cp if e and e % self.cp == 0 else 1

    @property
    def experts_per_rank(self) -> int:
        return -(-self.model.n_routed_experts // self.expert_shards)

    def caps(self, pages: int) -> AdmissionCaps:
        """The engine's caps for a pool of ``pages`` per rank (as ``EngineConfig.caps``: the cached cap is
        every pool's pages)."""
        return pool_caps(self.cp, self.page_size, pages, self.chunk_size, self.max_requests)

    def admission(self, pages: int) -> Admission:
        return Admission.build(self.caps(pages), self.model, CPConfig(self.cp, self.page_size),
                               logits_budget=self.logits_budget)


def busiest_rows(adm: Admission) -> int:
    """Query rows of the busiest rank in a full batch: its share of the chunk's pages rounded up, plus two
    pages per request (each request's pages split in runs over the ranks), at most the chunk."""
    pages = adm.chunk_tokens // adm.page_size
    return min(adm.chunk_tokens, (-(-pages // adm.cp) + 2 * adm.caps.max_requests) * adm.page_size)


def _quant_bytes(k: int) -> int:
    """Bytes per row of an activation quantised per 1 x 128 group (``model.linear.QuantAct``): fp8 values + float32
    scales."""
    return k + 4 * -(-k // 128)


def activation_parts(s: Setup, rows: int, keys: int, capacity: int | None = None) -> dict[str, int]:
    """Bytes of the tensors live at each phase of one layer's forward (``model.layer.DSALayer``) on a rank with
    ``rows`` query tokens T over ``keys`` dense keys K (``c``: the compute dtype's bytes; fp8 quantised rows
    ``_quant_bytes``) -> {"persistent", "project", "attention", "finish", "mlp", "moe"}; the peak is persistent + the
    largest phase. Estimated from the code, not measured one by one.

    persistent: the caller's h and delta and the layer's h + delta [T, d] (3), and the Projected the attention reads:
    the absorbed query [T, H, kv_lora + rope] (bf16 under fp8 precision), token and index rows, the indexer's q
    (fp8 [T, Hi, Di]) and head weights (float32 [T, Hi]). project: x and its quantised rows [T, d], the query latent
    normed and quantised [T, q_lora] (both kept: the QuantAct holds x), and q_b's output [T, H (nope + rope)] while the
    absorbed query is written. attention: the dense keys dequantised to bf16 [K, kv_lora + rope] (fp8 rows), the top-k
    [T, topk] int32, the latent output [T, H, kv_lora] and its lse float32 [T, H]; the indexer's logits chunk is its
    own item (``logits_bytes``). finish: the latent, W_UV's o [T, H, v], o_proj's output [T, d], the new x and its
    quantised rows. mlp (dense SwiGLU): the latent (the caller's), x and its rows, gate_up's [T, 2I], SwiGLU's
    quantised [T, I], down's [T, d]. moe: the latent, x and its rows, float32 router scores [T, E] (three), the
    routing [T, k]; the shared experts' [T, 2 I_s], [T, I_s] quantised, [T, d]; the pairs (``capacity`` rows: T k at
    cp 1, chunk x k of static capacity under expert parallelism, where receive and return buffers [., d] come too):
    their ids (three int64), quantised rows, weights, gate_up's [., 2 I_moe], SwiGLU's quantised [., I_moe], the
    outputs [., d]; the combine's [T, d].
    """
    m, t, c = s.model, rows, DTYPE_BYTES[s.compute]
    d, h, kr = m.hidden_size, m.num_heads, m.kv_lora_rank
    fp8 = m.kv_dtype == "fp8"
    q_bytes = 2 if fp8 else DTYPE_BYTES[m.kv_dtype]
    iq_bytes = 1 if fp8 else DTYPE_BYTES[m.kv_dtype]
    full = "full" in m.indexer_types
    x = t * (d * c + _quant_bytes(d))  # a norm's output and its quantised rows
    projected = t * (h * m.d_qk * q_bytes + sum(m.row_bytes(k) for k in KINDS))
    projected += t * m.index_n_heads * (m.index_head_dim * iq_bytes + 4) if full else 0
    parts = {"persistent": 3 * t * d * c + projected}
    parts["project"] = x + t * (m.q_lora_rank * c + _quant_bytes(m.q_lora_rank))
    parts["project"] += t * h * (m.qk_nope_head_dim + m.qk_rope_head_dim) * c
    latent = t * h * kr * c
    parts["attention"] = (keys * m.d_qk * 2 if fp8 else 0) + t * m.index_topk * 4 + latent + t * h * 4
    parts["finish"] = latent + t * h * m.v_head_dim * c + t * d * c + x
    parts["mlp"] = parts["moe"] = 0
    if "dense" in m.mlp_layer_types:
        i = m.intermediate_size
        parts["mlp"] = latent + x + t * (2 * i * c + _quant_bytes(i) + d * c)
    if "sparse" in m.mlp_layer_types:
        k, mi, si = m.num_experts_per_tok, m.moe_intermediate_size, m.moe_intermediate_size * m.n_shared_experts
        ep = s.expert_shards > 1
        if capacity is None:  # static under expert parallelism: every token of the chunk, k times
            capacity = s.caps(2).chunk_tokens(s.page_size) * k if ep else t * k
        pairs = capacity * (3 * 8 + _quant_bytes(d) + 4 + 2 * mi * c + _quant_bytes(mi) + d * c)
        pairs += capacity * 2 * d * c if ep else 0  # the exchange's receive and return buffers
        parts["moe"] = latent + x + 3 * t * m.n_routed_experts * 4 + t * k * 12
        parts["moe"] += t * (2 * si * c + _quant_bytes(si) + d * c) + pairs + t * d * c
    return parts


def activation_bytes(s: Setup, rows: int, keys: int, capacity: int | None = None) -> int:
    """The peak of ``activation_parts``: persistent + the largest phase."""
    parts = activation_parts(s, rows, keys, capacity)
    return parts["persistent"] + max(v for k, v in parts.items() if k != "persistent")


def decision_bytes(s: Setup, rows: int) -> int:
    """``cpkv.engine.taps.Recorder``'s device tensors when the run records its decisions (``Setup.record``: cpkv run
    verifies): every MoE layer's route and choice buffers (int64 + float32 [chunk, k], fixed) and, within a batch,
    every full layer's selection and its scores (int32 + float32 [T, topk]) until the batch's host copies."""
    if not s.record:
        return 0
    m = s.model
    chunk = s.caps(2).chunk_tokens(s.page_size)
    routes = m.mlp_layer_types.count("sparse") * chunk * m.num_experts_per_tok * 12
    return routes + m.indexer_types.count("full") * rows * m.index_topk * 8


def graph_bytes(s: Setup) -> int:
    """``cpkv.engine.graphs``' memory at ``s.graph_tokens`` rows: its fixed buffers (h, delta, the projection's h
    [T, d]; the latent [T, H, kv_lora]; cos, sin; the absorbed query; a layer's token and index rows; the indexer's
    query and head weights; BENCHMARKS.md) and the pool its captures keep,
    bounded by the activations of the pieces it captures (no dense keys; the MoE's pairs T k rows without expert
    parallelism, none with it: the exchange runs eagerly, and the R pieces' results take fixed buffers), and the
    allocator's segments (GRAPH_SEGMENT_SLACK)."""
    t = min(s.graph_tokens, s.chunk_size)  # as the engine caps it: no rank's batch is larger than the chunk
    if not t or s.device != "cuda":
        return 0
    m, c = s.model, DTYPE_BYTES[s.compute]
    q_bytes = 2 if m.kv_dtype == "fp8" else DTYPE_BYTES[m.kv_dtype]
    iq_bytes = 1 if m.kv_dtype == "fp8" else DTYPE_BYTES[m.kv_dtype]
    rows = sum(m.row_bytes(k) for k in KINDS)
    fixed = t * (3 * m.hidden_size * c + m.num_heads * m.kv_lora_rank * c + m.qk_rope_head_dim * 4
                 + m.num_heads * m.d_qk * q_bytes + rows + m.index_n_heads * (m.index_head_dim * iq_bytes + 4))
    ep = s.expert_shards > 1 and "sparse" in m.mlp_layer_types
    if ep:  # the R pieces' results: x and the shared experts' output [T, d], expert ids and weights [T, k]
        fixed += t * (2 * m.hidden_size * c + m.num_experts_per_tok * 12)
    acts = activation_bytes(s, t, 0, capacity=0 if ep else t * m.num_experts_per_tok)
    return fixed + acts + GRAPH_SEGMENT_SLACK


def items_at(s: Setup, pages: int) -> dict[str, int]:
    """Bytes per rank of every item (ITEMS) with a pool of ``pages`` pages per rank."""
    w = weight_bytes(s.model, s.weights, s.compute)
    adm = s.admission(pages)
    slots = adm.caps.max_slots(s.page_size)  # the largest batch: every cached page + request slack + a chunk
    rows, keys = busiest_rows(adm), slots * s.page_size
    activations = activation_bytes(s, rows, keys)
    logits = min(adm.logits_bytes(keys, rows), adm.logits_budget)
    fixed, share = WORKSPACE[s.device]
    kv_page = s.page_size * s.model.kv_bytes_per_token()
    return {
        "weights_bytes": w.replicated,
        "expert_bytes": w.expert * w.moe_layers * s.experts_per_rank,
        "kv_bytes": pages * kv_page + (s.host_pages * kv_page if s.device == "cpu" else 0),
        "staging_bytes": adm.staging_bytes,
        "compose_bytes": adm.dense_bytes(slots + adm.staging_pages) + ARENA_SLACK,
        "logits_bytes": logits,
        "activation_bytes": activations,
        "graph_bytes": graph_bytes(s),
        "decision_bytes": decision_bytes(s, rows),
        "workspace_bytes": fixed + int(share * (activations + logits)),
    }


@dataclass(frozen=True)
class MemoryPlan:
    """A plan's result: ``items`` per rank at ``pages`` pool pages; ``fits`` the budget with at least
    ``min_tokens`` KV tokens per rank (one full chunk's share of the busiest rank)."""

    setup: Setup
    pages: int
    items: dict[str, int] = field(default_factory=dict)
    min_tokens: int = 0

    @property
    def params(self) -> int:
        return weight_bytes(self.setup.model, self.setup.weights, self.setup.compute).params

    @property
    def total(self) -> int:
        return sum(self.items.values())

    @property
    def kv_tokens(self) -> int:
        """Cacheable tokens per rank: the pool's pages less the reserved page 0."""
        return (self.pages - 1) * self.setup.page_size

    @property
    def fits(self) -> bool:
        return self.total <= self.setup.budget and self.kv_tokens >= self.min_tokens

    def largest(self) -> tuple[str, int]:
        """(key, bytes) of the largest item."""
        return max(self.items.items(), key=lambda kv: kv[1])

    def weights_dtype(self) -> str:
        return "fp8" if self.setup.weights == "fp8" else {"bfloat16": "bf16", "float32": "float32"}[self.setup.compute]

    def to_json(self, model: str) -> dict:
        s = self.setup
        per_rank = {**self.items, "kv_tokens": self.kv_tokens, "kv_pages": self.pages, "total_bytes": self.total,
                    "budget_bytes": s.budget, "experts": s.experts_per_rank}
        return {"model": model, "cp": s.cp, "params": self.params, "weights_dtype": self.weights_dtype(),
                "fits": self.fits, "per_rank": per_rank,
                "node": {"kv_tokens_shared": s.cp * self.kv_tokens, "kv_tokens_replicated": self.kv_tokens}}


def plan_memory(s: Setup) -> MemoryPlan:
    """The plan of ``s``: at its pool, or (``pages_per_rank`` None) at the largest pool within the budget; a
    budget that holds no useful pool plans the smallest one (one chunk's share), which then does not fit."""
    rows = busiest_rows(s.admission(2))
    min_pages = 1 + -(-rows // s.page_size)
    if s.pages_per_rank is not None:  # the pool asked for: the engine's admission judges its size
        return MemoryPlan(s, s.pages_per_rank, items_at(s, s.pages_per_rank))
    pages = _largest_pool(s, min_pages)
    return MemoryPlan(s, pages or min_pages, items_at(s, pages or min_pages), rows)


def _largest_pool(s: Setup, low: int) -> int:
    """The most pages with every item within the budget (items grow with pages), or 0 when ``low`` does not fit."""
    def fits(p: int) -> bool:
        return sum(items_at(s, p).values()) <= s.budget

    if not fits(low):
        return 0
    high = low + max(1, s.budget // (s.page_size * s.model.kv_bytes_per_token()))
    while low < high:  # invariant: fits(low); the answer is in [low, high]
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def refusal(plan: MemoryPlan, where: str) -> str | None:
    """None when ``plan`` (of a given pool) fits, else one line: what it needs, what ``where`` has, and the
    option to change: --pages-per-rank when a smaller pool would fit, else the largest item's option."""
    if plan.fits:
        return None
    s = plan.setup
    need = f"the configuration needs {_gb(plan.total)} GB per rank, {where} has {_gb(s.budget)} GB"
    room = plan_memory(replace(s, pages_per_rank=None))
    if room.fits:
        return f"{need}: lower --pages-per-rank (now {s.pages_per_rank}; at most {room.pages} fit)"
    return f"{need}, even with the smallest pool; {largest_text(plan)}"


def largest_text(plan: MemoryPlan) -> str:
    """'the largest item is the expert shard (181.2 GB): change --cp ...'"""
    key, size = plan.largest()
    label, advice = next((lbl, adv) for k, lbl, adv in ITEMS if k == key)
    if key == "expert_bytes" and plan.setup.model.n_routed_experts:
        advice = expert_advice(plan)
    return f"the largest item is the {label} ({_gb(size)} GB): {advice}"


def expert_advice(plan: MemoryPlan) -> str:
    """What to change when the expert shard is the largest item: the --cp values that divide the routed experts
    (expert parallelism needs one) and make this plan fit (one GPU per rank, the same budget each); on the CPU,
    where the ranks share the host, the divisors; --num-layers when none fits."""
    s, e = plan.setup, plan.setup.model.n_routed_experts
    if s.expert_shards == 1 and s.cp > 1:
        now = f"{s.cp} does not divide the {e} routed experts, so every rank holds all of them"
    else:
        now = f"now {s.cp}: {s.experts_per_rank} of the {e} routed experts per rank"
    if s.device != "cuda":
        return f"change --cp ({now}) to a divisor of {e}, or lower --num-layers"
    fit = [d for d in divisors(e, MAX_ADVISED_CP) if d != s.cp and plan_memory(replace(s, cp=d)).fits]
    if not fit:
        return f"change --cp ({now}; no --cp that divides them fits) or lower --num-layers"
    shown = ", ".join(map(str, fit[:8])) + (f" ({len(fit) - 8} more)" if len(fit) > 8 else "")
    return f"change --cp ({now}) to a divisor of {e} that fits: {shown}; or lower --num-layers"


def divisors(n: int, limit: int) -> list[int]:
    """The divisors of ``n`` (>= 1) up to ``limit``, ascending."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return sorted({x for d in small for x in (d, n // d) if x <= limit})


def reference_bytes(model: ModelConfig, weights: str, compute: str, device: str) -> int:
    """Bytes the single-rank reference (``cpkv run --verify``) needs before any activation: the whole model,
    every expert, on one device, plus the fixed workspace."""
    w = weight_bytes(model, weights, compute)
    return w.replicated + w.expert * w.moe_layers * model.n_routed_experts + WORKSPACE[device][0]


def _gb(n: int) -> str:
    return f"{n / GB:.1f}"

"""Model shapes from a preset name or a checkpoint directory's ``config.json``. No torch import.

``config.json`` is read as transformers reads the public GLM-5 (``model_type`` ``glm_moe_dsa``) and
DeepSeek-V3.2 (``deepseek_v32``) configs: the shape keys (``num_hidden_layers``, ``num_attention_heads``,
``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``, ``v_head_dim``,
``index_n_heads``, ``index_head_dim``, ``index_topk``, ``intermediate_size``, ``vocab_size``,
``max_position_embeddings``), the MoE keys (``n_routed_experts``, ``n_shared_experts``,
``num_experts_per_tok``, ``moe_intermediate_size``, ``n_group``, ``topk_group``, ``norm_topk_prob``,
``routed_scaling_factor``, ``first_k_dense_replace`` or ``mlp_layer_types``), RoPE (``rope_parameters``
or the older ``rope_scaling`` + ``rope_theta``, plain or YaRN) and, for GLM-5, the indexer pattern in any
of its three forms: ``indexer_types`` (a list of "full"/"shared"), ``index_topk_pattern`` ("FSSF..." or a
list), or ``index_topk_freq`` + ``index_skip_topk_offset``. DeepSeek-V3.2 runs the indexer on every layer
and rotates its rope dims in halves; GLM-5 rotates them interleaved.

Every field is checked for its JSON type and range before use, each problem one CheckpointError naming the
key: ``model_type`` is required; the shape keys and the MoE counts are integers >= 1
(``first_k_dense_replace``, ``n_shared_experts``, ``index_skip_topk_offset`` >= 0); ``rms_norm_eps``,
``routed_scaling_factor`` and ``rope_theta`` finite numbers > 0 (no NaN, no Infinity); ``norm_topk_prob``
a JSON boolean (``"false"``, a string, is refused: it would read as true); the per-layer patterns lists
naming every layer with the allowed values.
"""
from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

from cpkv.config import PRESET_PREFIX, PRESETS, ModelConfig, RopeConfig, model_source, preset
from cpkv.errors import CheckpointError, ConfigError
from cpkv.files import absent

PRECISIONS = ("fp8", "exact")
COMPUTE_DTYPES = {"cuda": "bfloat16", "cpu": "float32"}  # the model dtype per device (cpkv.model.model.default_dtype)
MODEL_TYPES = {"glm_moe_dsa": "GlmMoeDsaForCausalLM", "deepseek_v32": "DeepseekV32ForCausalLM"}

# ModelConfig field <- config.json key (required)
HF_KEYS: dict[str, str] = {
    "num_layers": "num_hidden_layers",
    "hidden_size": "hidden_size",
    "num_heads": "num_attention_heads",
    "q_lora_rank": "q_lora_rank",
    "kv_lora_rank": "kv_lora_rank",
    "qk_nope_head_dim": "qk_nope_head_dim",
    "qk_rope_head_dim": "qk_rope_head_dim",
    "v_head_dim": "v_head_dim",
    "index_n_heads": "index_n_heads",
    "index_head_dim": "index_head_dim",
    "index_topk": "index_topk",
    "intermediate_size": "intermediate_size",
    "vocab_size": "vocab_size",
    "max_context": "max_position_embeddings",
}
# optional keys and their defaults when absent (transformers' config defaults)
INT_KEYS = {"first_k_dense_replace": 3, "moe_intermediate_size": 2048, "n_routed_experts": 256,
            "n_shared_experts": 1, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1}
ZERO_OK = ("first_k_dense_replace", "n_shared_experts")  # integer keys that may be 0; the others must be >= 1
FLOAT_KEYS = {"rms_norm_eps": 1e-6, "routed_scaling_factor": 2.5}  # finite and > 0
YARN_KEYS = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def config_from_dict(raw: dict[str, Any], name: str = "checkpoint") -> ModelConfig:
    """A ModelConfig from a parsed ``config.json`` (problems named in a CheckpointError)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{name}: config.json must hold a JSON object, got {type(raw).__name__}")
    if "model_type" not in raw:
        raise CheckpointError(f"{name}: config.json lacks model_type (expected one of {', '.join(MODEL_TYPES)})")
    model_type = raw["model_type"]
    if not isinstance(model_type, str) or model_type not in MODEL_TYPES:
        raise CheckpointError(f"{name}: config.json model_type {model_type!r} is not supported; expected one of "
                              f"{', '.join(MODEL_TYPES)}")
    missing = [key for key in HF_KEYS.values() if key not in raw]
    if missing:
        raise CheckpointError(f"{name}: config.json lacks {', '.join(missing)}")
    try:
        values: dict[str, Any] = {field: _int(raw[key], key, 1) for field, key in HF_KEYS.items()}
        values.update({k: _int(raw.get(k, d), k, 0 if k in ZERO_OK else 1) for k, d in INT_KEYS.items()})
        values.update({k: _positive(raw.get(k, d), k) for k, d in FLOAT_KEYS.items()})
        values["norm_topk_prob"] = _bool(raw.get("norm_topk_prob", True), "norm_topk_prob")
        values["rope"] = rope_from_dict(raw, values["max_context"])
        values.update(_patterns(raw, model_type, values["num_layers"]))
        return ModelConfig(name=name, model_type=model_type,
                           indexer_rope="interleaved" if model_type == "glm_moe_dsa" else "halves", **values)
    except (TypeError, ValueError, KeyError) as exc:  # ConfigError is a ValueError
        raise CheckpointError(f"{name}: config.json: {exc}") from None


def _int(x: Any, key: str = "value", low: int | None = None) -> int:
    """A JSON integer (an integral float such as 4.0 too; not a bool, not a string), >= ``low`` if given."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or int(x) != x:
        raise ValueError(f"{key}: expected an integer{'' if low is None else f' >= {low}'}, got {x!r}")
    if low is not None and x < low:
        raise ValueError(f"{key}: expected an integer >= {low}, got {int(x)}")
    return int(x)


def _number(x: Any, key: str) -> float:
    """A finite JSON number (not a bool, not a string, not NaN or Infinity)."""
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise ValueError(f"{key}: expected a finite number, got {x!r}")
    return float(x)


def _positive(x: Any, key: str) -> float:
    if _number(x, key) <= 0:
        raise ValueError(f"{key}: expected a finite number > 0, got {x!r}")
    return float(x)


def _bool(x: Any, key: str) -> bool:
    if not isinstance(x, bool):
        raise ValueError(f"{key}: expected true or false (a JSON boolean), got {x!r}")
    return x


def rope_from_dict(raw: dict[str, Any], max_positions: int) -> RopeConfig:
    """RoPE as transformers standardises it: ``rope_parameters`` or ``rope_scaling``; theta from there or
    ``rope_theta``; YaRN's original length defaults to ``max_position_embeddings``."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be an object, got {params!r}")
    theta = _positive(params.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    original = _int(params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings",
                                                                             max_positions)),
                    "original_max_position_embeddings", 1)
    extra = {k: _number(params[k], k) for k in YARN_KEYS if params.get(k) is not None}
    if "factor" not in extra:
        extra["factor"] = max_positions / original
    return RopeConfig(theta=theta, type=kind, original_max_position_embeddings=original,
                      truncate=_bool(params.get("truncate", True), "truncate"), **extra)


def _patterns(raw: dict[str, Any], model_type: str, layers: int) -> dict[str, Any]:
    """Indexer and MLP per-layer patterns from whichever form the config uses."""
    out: dict[str, Any] = {}
    if raw.get("mlp_layer_types") is not None:
        out["mlp_pattern"] = _layer_list(raw["mlp_layer_types"], "mlp_layer_types", ("dense", "sparse"), layers)
    if model_type != "glm_moe_dsa":
        return out  # DeepSeek-V3.2: every layer runs its indexer
    types, pattern = raw.get("indexer_types"), raw.get("index_topk_pattern")
    if types is not None:
        out["indexer_pattern"] = _layer_list(types, "indexer_types", ("full", "shared"), layers)
    elif pattern is not None:
        letters = {"F": "full", "S": "shared"}
        if not isinstance(pattern, (str, list)):
            raise ValueError(f"index_topk_pattern: expected a string of F/S, one letter per layer, or a list of "
                             f"'full' / 'shared'; got {type(pattern).__name__} {str(pattern)[:80]!r}")
        if isinstance(pattern, str):
            bad = next((i for i, c in enumerate(pattern) if c not in letters), None)
            if bad is not None:
                raise ValueError(f"index_topk_pattern: expected one letter per layer, F (full) or S (shared), got "
                                 f"{pattern[bad]!r} at layer {bad} of {pattern[:80]!r}")
            out["indexer_pattern"] = _layer_list([letters[c] for c in pattern], "index_topk_pattern", ("full", "shared"),
                                                 layers)
        else:
            out["indexer_pattern"] = _layer_list(pattern, "index_topk_pattern", ("full", "shared"), layers)
    else:
        out["index_topk_freq"] = max(_int(raw.get("index_topk_freq", 1), "index_topk_freq", 0), 1)  # 0 reads as 1
        out["index_skip_topk_offset"] = _int(raw.get("index_skip_topk_offset", 2), "index_skip_topk_offset", 0)
    return out


def _layer_list(value: Any, key: str, allowed: tuple[str, ...], layers: int) -> tuple[str, ...]:
    """A per-layer pattern of config.json: a list of ``allowed`` names, one per layer (num_hidden_layers)."""
    if not isinstance(value, list):
        raise ValueError(f"{key}: expected a list of {' / '.join(map(repr, allowed))}, one per layer, got "
                         f"{type(value).__name__} {str(value)[:80]!r}")
    bad = next((i for i, v in enumerate(value) if v not in allowed), None)
    if bad is not None:
        raise ValueError(f"{key}: expected {' or '.join(map(repr, allowed))} for every layer, got {value[bad]!r} at "
                         f"layer {bad}")
    if len(value) != layers:
        raise ValueError(f"{key}: expected one entry per layer (num_hidden_layers = {layers}), got {len(value)}")
    return tuple(value)


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The inverse of ``config_from_dict``: the config.json transformers writes for this model."""
    out: dict[str, Any] = {key: getattr(cfg, field) for field, key in HF_KEYS.items()}
    out.update({k: getattr(cfg, k) for k in (*INT_KEYS, *FLOAT_KEYS, "norm_topk_prob")})
    out["model_type"] = cfg.model_type
    out["architectures"] = [MODEL_TYPES[cfg.model_type]]
    if cfg.mlp_pattern:
        out["mlp_layer_types"] = list(cfg.mlp_pattern)
    if cfg.model_type == "glm_moe_dsa" and cfg.indexer_pattern:
        out["indexer_types"] = list(cfg.indexer_pattern)
    elif cfg.model_type == "glm_moe_dsa":
        out.update(index_topk_freq=cfg.index_topk_freq, index_skip_topk_offset=cfg.index_skip_topk_offset)
    elif cfg.full_layers != tuple(range(cfg.num_layers)):
        raise ConfigError(f"{cfg.name}: a deepseek_v32 config.json cannot express shared indexer layers")
    r = cfg.rope
    params: dict[str, Any] = {"rope_type": r.type, "rope_theta": r.theta}
    if r.type == "yarn":
        params.update(factor=r.factor, original_max_position_embeddings=r.original_max_position_embeddings,
                      beta_fast=r.beta_fast, beta_slow=r.beta_slow, truncate=r.truncate)
        params.update({k: getattr(r, k) for k in ("mscale", "mscale_all_dim", "attention_factor") if getattr(r, k)})
    out["rope_parameters"] = params
    return out


def load_model_config(spec: str, num_layers: int | None = None, experts: int | None = None) -> ModelConfig:
    """``spec``: a preset (``preset:glm5``, or plain ``glm5`` while no such directory exists: ``model_source``)
    or a directory holding config.json.

    ``num_layers`` keeps the first layers only (benchmarks run a few layers at real shapes; the
    per-layer patterns are cut to match). ``experts``: route over that many experts per MoE layer
    (``ModelConfig.with_experts``: one rank's share on one GPU; presets only, whose weights are drawn).
    """
    kind, where = model_source(spec)
    if kind == "preset":
        cfg = preset(where)
    else:
        path = Path(spec)
        if path.is_dir() and not (path / "config.json").is_file() and absent(path / "config.json") != "lacks":
            raise ConfigError(f"--model {spec!r}: config.json: the directory {absent(path / 'config.json')}")
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {spec!r}: expected a preset ({', '.join(PRESETS)}; or "
                              f"{PRESET_PREFIX}NAME) or a directory holding config.json")
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:  # ValueError: bad JSON or undecodable bytes
            raise CheckpointError(f"{path / 'config.json'}: expected a JSON object of model fields ({exc})") from None
        cfg = config_from_dict(raw, name=path.name or str(path))
    if num_layers is not None:
        cfg = cfg.with_layers(num_layers)
    if experts is not None:
        if kind != "preset":
            raise ConfigError(f"--experts {experts}: only with a preset model (its weights are drawn, so fewer "
                              f"experts stay a well-defined model); {spec!r} is a checkpoint")
        cfg = cfg.with_experts(experts)
    return cfg


def with_precision(cfg: ModelConfig, precision: str, compute_dtype: str) -> ModelConfig:
    """``cfg`` with the KV dtype of ``precision``: fp8 rows, or (``exact``) rows in the compute dtype
    (``COMPUTE_DTYPES``: float32 on CPU, bfloat16 on CUDA). The ranks run this config; so must the parent."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    return dataclasses.replace(cfg, kv_dtype="fp8" if precision == "fp8" else compute_dtype)
WEIGHTS_MODES = ("auto", "fp8", "bf16")


def fp8_block_checkpoint(spec: str) -> bool:
    """True when ``spec`` is a checkpoint directory whose config.json declares DeepSeek's fp8 block format
    (``quantization_config``: quant_method fp8, weight_block_size [128, 128]); False for a preset."""
    if spec in PRESETS or not (Path(spec) / "config.json").is_file():  # is_file: never opens a FIFO
        return False
    try:
        q = json.loads((Path(spec) / "config.json").read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return False
    if not isinstance(q, dict):
        return False
    return q.get("quant_method") == "fp8" and list(q.get("weight_block_size") or []) == [128, 128]


def resolve_weights(weights: str, spec: str, device: str, precision: str) -> str:
    """``--weights`` -> "fp8" (linear weights kept block-scaled fp8) or "bf16" (widened to the compute dtype).
    ``auto``: fp8 for an fp8 block checkpoint on CUDA at fp8 precision, else bf16; fp8 / bf16 as asked (fp8 on
    CPU runs the dequantising reference path)."""
    if weights not in WEIGHTS_MODES:
        raise ConfigError(f"weights must be one of {', '.join(WEIGHTS_MODES)}, got {weights!r}")
    if weights != "auto":
        return weights
    return "fp8" if device == "cuda" and precision == "fp8" and fp8_block_checkpoint(spec) else "bf16"

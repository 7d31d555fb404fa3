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
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from cpkv.config import PRESET_PREFIX, PRESETS, ModelConfig, RopeConfig, model_source, preset
from cpkv.errors import CheckpointError, ConfigError
from cpkv.files import absent

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
FLOAT_KEYS = {"rms_norm_eps": 1e-6, "routed_scaling_factor": 2.5}
YARN_KEYS = ("factor", "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")


def config_from_dict(raw: dict[str, Any], name: str = "checkpoint") -> ModelConfig:
    """A ModelConfig from a parsed ``config.json`` (problems named in a CheckpointError)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{name}: config.json must hold a JSON object, got {type(raw).__name__}")
    model_type = raw.get("model_type", "deepseek_v32")
    if model_type not in MODEL_TYPES:
        raise CheckpointError(f"{name}: config.json model_type {model_type!r} is not supported; expected one of "
                              f"{', '.join(MODEL_TYPES)}")
    missing = [key for key in HF_KEYS.values() if key not in raw]
    if missing:
        raise CheckpointError(f"{name}: config.json lacks {', '.join(missing)}")
    try:
        values: dict[str, Any] = {field: _int(raw[key]) for field, key in HF_KEYS.items()}
        values.update({k: _int(raw.get(k, d)) for k, d in INT_KEYS.items()})
        values.update({k: float(raw.get(k, d)) for k, d in FLOAT_KEYS.items()})
        values["norm_topk_prob"] = bool(raw.get("norm_topk_prob", True))
        values["rope"] = rope_from_dict(raw, values["max_context"])
        values.update(_patterns(raw, model_type, values["num_layers"]))
        return ModelConfig(name=name, model_type=model_type,
                           indexer_rope="interleaved" if model_type == "glm_moe_dsa" else "halves", **values)
    except (TypeError, ValueError, KeyError) as exc:  # ConfigError is a ValueError
        raise CheckpointError(f"{name}: config.json: {exc}") from None


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or int(x) != x:
        raise ValueError(f"expected an integer, got {x!r}")
    return int(x)


def rope_from_dict(raw: dict[str, Any], max_positions: int) -> RopeConfig:
    """RoPE as transformers standardises it: ``rope_parameters`` or ``rope_scaling``; theta from there or
    ``rope_theta``; YaRN's original length defaults to ``max_position_embeddings``."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ValueError(f"rope_parameters must be an object, got {params!r}")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return RopeConfig(theta=theta)
    original = _int(params.get("original_max_position_embeddings", raw.get("original_max_position_embeddings",
                                                                             max_positions)))
    extra = {k: float(params[k]) for k in YARN_KEYS if params.get(k) is not None}
    if "factor" not in extra:
        extra["factor"] = max_positions / original
    return RopeConfig(theta=theta, type=kind, original_max_position_embeddings=original,
                      truncate=bool(params.get("truncate", True)), **extra)


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
        out["index_topk_freq"] = max(_int(raw.get("index_topk_freq", 1)), 1)
        out["index_skip_topk_offset"] = _int(raw.get("index_skip_topk_offset", 2))
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


def load_model_config(spec: str, num_layers: int | None = None) -> ModelConfig:
    """``spec``: a preset (``preset:glm5``, or plain ``glm5`` while no such directory exists: ``model_source``)
    or a directory holding config.json.

    ``num_layers`` keeps the first layers only (benchmarks run a few layers at real shapes; the
    per-layer patterns are cut to match).
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
    return cfg

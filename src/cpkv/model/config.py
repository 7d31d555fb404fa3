"""Model shapes from a preset name or a checkpoint directory's ``config.json``. No torch import.

``config.json`` uses the public key names of DeepSeek-V3.2 / GLM-5 (``num_hidden_layers``,
``num_attention_heads``, ``q_lora_rank``, ``kv_lora_rank``, ``qk_nope_head_dim``, ``qk_rope_head_dim``,
``v_head_dim``, ``index_n_heads``, ``index_head_dim``, ``index_topk``, ``intermediate_size``,
``vocab_size``, ``max_position_embeddings``, ``rope_theta``, ``rms_norm_eps``).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from cpkv.config import PRESETS, ModelConfig, preset
from cpkv.errors import CheckpointError, ConfigError

# ModelConfig field <- config.json key
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
OPTIONAL_KEYS: dict[str, str] = {"rope_theta": "rope_theta", "rms_norm_eps": "rms_norm_eps"}


def config_from_dict(raw: dict[str, Any], name: str = "checkpoint") -> ModelConfig:
    """A ModelConfig from a parsed ``config.json`` (missing keys named in a CheckpointError)."""
    if not isinstance(raw, dict):
        raise CheckpointError(f"{name}: config.json must hold a JSON object, got {type(raw).__name__}")
    missing = [key for key in HF_KEYS.values() if key not in raw]
    if missing:
        raise CheckpointError(f"{name}: config.json lacks {', '.join(missing)}")
    try:
        values: dict[str, Any] = {field: int(raw[key]) for field, key in HF_KEYS.items()}
        values.update({field: float(raw[key]) for field, key in OPTIONAL_KEYS.items() if key in raw})
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{name}: config.json holds a non-numeric model field ({exc})") from None
    return ModelConfig(name=name, **values)


def config_to_dict(cfg: ModelConfig) -> dict[str, Any]:
    """The inverse of ``config_from_dict`` (what a checkpoint's config.json holds)."""
    out: dict[str, Any] = {key: getattr(cfg, field) for field, key in HF_KEYS.items()}
    out.update({key: getattr(cfg, field) for field, key in OPTIONAL_KEYS.items()})
    out["architectures"] = ["DeepseekV32ForCausalLM"]
    return out


def load_model_config(spec: str, num_layers: int | None = None) -> ModelConfig:
    """``spec``: a preset name (tiny, glm5, deepseek-v32) or a directory holding config.json.

    ``num_layers`` overrides the depth (benchmarks run a few layers at real shapes).
    """
    if spec in PRESETS:
        cfg = preset(spec)
    else:
        path = Path(spec)
        if not (path / "config.json").is_file():
            raise ConfigError(f"--model {spec!r}: expected a preset ({', '.join(PRESETS)}) or a directory "
                              f"holding config.json")
        try:
            raw = json.loads((path / "config.json").read_text())
        except (OSError, ValueError) as exc:  # ValueError: bad JSON or undecodable bytes
            raise CheckpointError(f"{path / 'config.json'}: expected a JSON object of model fields ({exc})") from None
        cfg = config_from_dict(raw, name=path.name or str(path))
    if num_layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=num_layers)
    return cfg

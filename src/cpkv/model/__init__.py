"""GLM-5 / DeepSeek-V3.2 as their public checkpoints define them, and their per-rank layer halves.

    load_model_config(spec)            preset name or checkpoint dir (config.json) -> ModelConfig
    load_model(spec, precision=...)    fp8 or exact KV rows; a checkpoint's safetensors checked, then loaded
    DSAModel.random(cfg, seed) / DSAModel.from_pretrained(dir, cfg)
    model.embed / model.rotary / layer.project / layer.attend / model.logits   (engine pieces)
    model.reference_prefill(tokens)    single-process cp = 1 prefill -> last-token logits
"""
from __future__ import annotations

from cpkv.model.config import config_from_dict, config_to_dict, load_model_config

__all__ = ["load_model_config", "config_from_dict", "config_to_dict", "DSAModel", "AttnPlan", "DSALayer",
           "Projected", "load_model"]


def __getattr__(name: str):
    if name == "DSAModel":
        from cpkv.model.model import DSAModel
        return DSAModel
    if name in ("AttnPlan", "DSALayer", "Projected"):
        from cpkv.model import layer
        return getattr(layer, name)
    if name == "load_model":
        from cpkv.model.model import load_model
        return load_model
    raise AttributeError(name)

"""The DSA transformer: embeddings, decoder layers (``DSALayer``), final RMSNorm and LM head.

``reference_prefill`` is the single-process path (cp = 1, no cache, no compose): each request's whole
sequence runs through every layer with its KV rows stacked as the dense buffer (key j at row j). The CP
engine must reproduce its first tokens and, within tolerance, its last-token logits.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F

from cpkv.config import ModelConfig
from cpkv.errors import ConfigError
from cpkv.model.layer import AttnPlan, DSALayer
from cpkv.model.ops import Rotary, rms_norm
from cpkv.model.weights import Weights, check_weights, load_weights, random_weights

PRECISIONS = ("fp8", "exact")


FLOAT32_WEIGHTS = ("e_score_correction_bias", "indexer.weights_proj.weight")  # kept in float32, as transformers


def default_dtype(device: torch.device | str) -> torch.dtype:
    """Compute dtype: bfloat16 on CUDA, float32 on CPU (bf16 matmuls are slow there)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _dtype_of(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FLOAT32_WEIGHTS) else dtype


def precision_config(cfg: ModelConfig, precision: str, dtype: torch.dtype) -> ModelConfig:
    """``cfg`` with the KV dtype of ``precision``: fp8 rows, or (``exact``) rows in the compute dtype."""
    if precision not in PRECISIONS:
        raise ConfigError(f"precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    kv = "fp8" if precision == "fp8" else {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    return dataclasses.replace(cfg, kv_dtype=kv)


class DSAModel:
    """A DSA model on one device. ``dtype`` is the dtype of weights, hidden states and matmuls."""

    def __init__(self, cfg: ModelConfig, weights: Weights, device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None) -> None:
        check_weights(weights, cfg)
        self.cfg, self.device = cfg, torch.device(device)
        self.dtype = dtype or default_dtype(self.device)
        self.weights = {k: v.to(device=self.device, dtype=_dtype_of(k, self.dtype)) for k, v in weights.items()}
        self.layers = [DSALayer(cfg, self.weights, n) for n in range(cfg.num_layers)]
        # routed experts live stacked in their layers now
        self.weights = {k: v for k, v in self.weights.items() if ".mlp.experts." not in k}

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None) -> "DSAModel":
        dtype = dtype or default_dtype(device)
        return cls(cfg, random_weights(cfg, seed, dtype, device), device, dtype)

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg: ModelConfig, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None) -> "DSAModel":
        dtype = dtype or default_dtype(device)
        return cls(cfg, load_weights(path, cfg, dtype, device), device, dtype)

    # -- pieces the engine calls -------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 [T] -> h [T, hidden] (compute dtype)."""
        return F.embedding(tokens.to(self.device), self.weights["model.embed_tokens.weight"])

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return Rotary.build(positions.to(self.device), self.cfg.qk_rope_head_dim, self.cfg.rope)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h [N, hidden] -> float32 [N, vocab] after the final norm and the LM head."""
        x = rms_norm(h, self.weights["model.norm.weight"], self.cfg.rms_norm_eps)
        return F.linear(x, self.weights["lm_head.weight"]).float()

    def layer_stats(self) -> dict[str, int]:
        """Attention calls per path over all layers: {"dense": n, "sparse": n}."""
        return {k: sum(layer.stats[k] for layer in self.layers) for k in ("dense", "sparse")}

    # -- the single-process reference ---------------------------------------------------------------
    def reference_prefill(self, tokens: Sequence[int]) -> torch.Tensor:
        """One request from scratch on one process -> float32 [vocab] logits of its last token."""
        n = len(tokens)
        ids = torch.tensor(list(tokens), dtype=torch.int64, device=self.device)
        rot = self.rotary(torch.arange(n, device=self.device))
        plan = AttnPlan.build([0] * n, list(range(1, n + 1)), self.cfg.index_topk, self.device)
        h, topk = self.embed(ids), None
        for layer in self.layers:
            p = layer.project(h, rot)
            h, topk = layer.attend(h, p, {"token": p.token, "index": p.index}, plan, topk)
        return self.logits(h[-1:])[0]


def load_model(spec: str, *, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               num_layers: int | None = None, precision: str = "fp8") -> DSAModel:
    """``spec``: a preset (random weights from ``seed``) or a checkpoint directory (config.json + safetensors).
    ``precision``: fp8 KV rows, or ``exact`` (rows, indexer keys and queries in the compute dtype)."""
    from cpkv.model.config import load_model_config

    dtype = dtype or default_dtype(device)
    cfg = precision_config(load_model_config(spec, num_layers), precision, dtype)
    from cpkv.config import model_source

    if model_source(spec)[0] == "dir":  # the same decision as load_model_config's
        return DSAModel.from_pretrained(spec, cfg, device, dtype)
    return DSAModel.random(cfg, seed, device, dtype)

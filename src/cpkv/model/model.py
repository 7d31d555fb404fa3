"""The DSA transformer: embeddings, decoder layers (``DSALayer``), final RMSNorm and LM head.

``reference_prefill`` is the single-process path (cp = 1, no cache, no compose): each request's whole
sequence runs through every layer with its KV rows stacked as the dense buffer (key j at row j). The CP
engine must reproduce its first tokens and, within tolerance, its last-token logits.
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from cpkv.config import ModelConfig
from cpkv.kernels.platform import Backends, resolve
from cpkv.model.config import PRECISIONS, with_precision  # noqa: F401  (PRECISIONS re-exported)
from cpkv.model.layer import AttnPlan, DSALayer
from cpkv.model.ops import Rotary, rms_norm
from cpkv.model.weights import (Weights, by_layer, check_weights, is_fp8, load_weights, random_weight_groups,  # noqa: F401
                               random_weights, to_dense, to_fp8)


FLOAT32_WEIGHTS = ("e_score_correction_bias", "indexer.weights_proj.weight")  # kept in float32, as transformers


def default_dtype(device: torch.device | str) -> torch.dtype:
    """Compute dtype: bfloat16 on CUDA, float32 on CPU (bf16 matmuls are slow there)."""
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def _dtype_of(name: str, dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if name.endswith(FLOAT32_WEIGHTS + ("_scale_inv",)) else dtype


def _place(name: str, w: torch.Tensor, device: torch.device, dtype: torch.dtype) -> torch.Tensor:
    """On ``device``; fp8 weights stay fp8, block scales float32, the rest in their compute dtype."""
    return w.to(device) if is_fp8(w) else w.to(device=device, dtype=_dtype_of(name, dtype))


def precision_config(cfg: ModelConfig, precision: str, dtype: torch.dtype) -> ModelConfig:
    """``cfg`` with the KV dtype of ``precision``: fp8 rows, or (``exact``) rows in the compute dtype
    (``cpkv.model.config.with_precision``, which the parent process calls through ``EngineConfig.model_config``)."""
    return with_precision(cfg, precision, {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])


class DSAModel:
    """A DSA model on one device. ``dtype`` is the dtype of hidden states, matmuls and dense weights.

    ``fp8``: the linear weights ``weights.fp8_kept`` names stay (or are quantised to) float8_e4m3fn with
    128 x 128 block scales and run block-scaled fp8 GEMMs (``model.linear``); else every weight is widened
    to ``dtype`` (fp8 ones dequantised). ``backends``: the kernels it runs, chosen once when it is built
    (``cpkv.kernels.platform.resolve`` of its device: the platform and the ``CPKV_*`` environment read then) and
    handed to every layer, linear and expert block."""

    def __init__(self, cfg: ModelConfig, weights: Weights | Iterable[Weights], device: torch.device | str = "cpu",
                 dtype: torch.dtype | None = None, experts: range | None = None, *, fp8: bool = False,
                 consume: bool = False, backends: Backends | None = None) -> None:
        """``weights``: every tensor in one dict (checked whole first), or the groups ``random_weight_groups`` yields
        (the outer tensors, then each layer's in order). The model is built one group at a time: a group's tensors
        converted to their stored form and placed, then its layer built (experts stacked, their per-expert tensors
        dropped) before the next group is touched, so the load's peak is the kept model plus one layer's
        transients. ``experts``: the routed experts this process holds (expert parallelism: one rank's block,
        ``cpkv.model.moe.expert_block``); None: all of them (the single-process model). ``consume``: the model
        takes a ``weights`` dict (emptied as its tensors are placed; ``random`` and ``from_pretrained`` pass it).
        ``backends``: None resolves them."""
        self.cfg, self.device, self.fp8 = cfg, torch.device(device), fp8
        self.backends = backends or resolve(self.device)
        self.dtype = dtype or default_dtype(self.device)
        self.experts = range(cfg.n_routed_experts) if experts is None else experts
        quantise = None
        if isinstance(weights, dict):
            check_weights(weights, cfg, experts=experts)
            quantise = not any(is_fp8(w) for w in weights.values())  # decided over the whole model, as to_fp8
            weights = by_layer(weights if consume else dict(weights), cfg.num_layers)
        self.weights: Weights = {}
        self.layers: list[DSALayer] = []
        self.tap = None  # set_tap
        for i, group in enumerate(weights):
            self._place_group(group, quantise)
            if i:
                self._build_layer(i - 1)
        assert len(self.layers) == cfg.num_layers, (len(self.layers), cfg.num_layers)

    def _place_group(self, group: Weights, quantise: bool | None) -> None:
        """One group's tensors in their stored form (fp8 + block scales where ``fp8_kept`` and ``fp8``, else the
        compute dtype; two kept float32) on the device, into ``self.weights``; the group emptied."""
        src = to_fp8(group, consume=True, quantise=quantise) if self.fp8 else to_dense(group, self.dtype, consume=True)
        for k in list(src):
            self.weights[k] = _place(k, src.pop(k), self.device, self.dtype)

    def _build_layer(self, n: int) -> None:
        self.layers.append(DSALayer(self.cfg, self.weights, n, self.experts, self.backends))
        prefix = f"model.layers.{n}.mlp.experts."  # stacked in the layer now: the per-expert tensors go
        for k in [k for k in self.weights if k.startswith(prefix)]:
            del self.weights[k]

    @classmethod
    def random(cls, cfg: ModelConfig, seed: int = 0, device: torch.device | str = "cpu",
               dtype: torch.dtype | None = None, experts: range | None = None, *, fp8: bool = False,
               backends: Backends | None = None) -> "DSAModel":
        """Seeded random weights (``random_weights``' values) drawn on ``device`` layer by layer, each fp8 weight
        quantised as it is drawn: the host holds nothing, the device the kept model plus one layer's transients."""
        dtype = dtype or default_dtype(device)
        groups = random_weight_groups(cfg, seed, dtype, device, experts, fp8=fp8)
        return cls(cfg, groups, device, dtype, experts, fp8=fp8, consume=True, backends=backends)

    @classmethod
    def from_pretrained(cls, path: str | Path, cfg: ModelConfig, device: torch.device | str = "cpu",
                        dtype: torch.dtype | None = None, experts: range | None = None, *,
                        fp8: bool = False, backends: Backends | None = None) -> "DSAModel":
        dtype = dtype or default_dtype(device)
        return cls(cfg, load_weights(path, cfg, dtype, device, experts, fp8=fp8), device, dtype, experts, fp8=fp8,
                   consume=True, backends=backends)

    @property
    def expert_parallel(self) -> bool:
        """True when this process holds only a block of the routed experts (MoE layers need the exchange)."""
        moe = "sparse" in self.cfg.mlp_layer_types
        return moe and len(self.experts) < self.cfg.n_routed_experts

    @property
    def weights_dtype(self) -> str:
        """What the linear weights are kept in: "fp8", or the compute dtype ("bf16", "float32")."""
        if self.fp8:
            return "fp8"
        return {torch.bfloat16: "bf16", torch.float32: "float32"}.get(self.dtype, str(self.dtype))

    # -- pieces the engine calls -------------------------------------------------------------------
    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """tokens int64 [T] -> h [T, hidden] (compute dtype)."""
        return F.embedding(tokens.to(self.device), self.weights["model.embed_tokens.weight"])

    def rotary(self, positions: torch.Tensor) -> Rotary:
        return Rotary.build(positions.to(self.device), self.cfg.qk_rope_head_dim, self.cfg.rope)

    def logits(self, h: torch.Tensor, delta: torch.Tensor | None = None) -> torch.Tensor:
        """h [N, hidden] (plus ``delta`` [N, hidden], the last layer's MLP output not yet added) -> float32
        [N, vocab] after the final norm and the LM head."""
        h = h if delta is None else h + delta
        x = rms_norm(h, self.weights["model.norm.weight"], self.cfg.rms_norm_eps)
        return F.linear(x, self.weights["lm_head.weight"]).float()

    def layer_stats(self) -> dict[str, int]:
        """Attention calls per path over all layers: {"dense": n, "sparse": n}."""
        return {k: sum(layer.stats[k] for layer in self.layers) for k in ("dense", "sparse")}

    # -- the single-process reference ---------------------------------------------------------------
    def set_tap(self, tap) -> None:
        """Route every layer's discrete decisions through ``tap`` (``cpkv.engine.taps``); None: decided in place."""
        self.tap = tap
        for layer in self.layers:
            layer.tap = tap

    def reference_prefill(self, tokens: Sequence[int],
                          after_layer: Callable[[int, torch.Tensor], None] | None = None,
                          tap=None, cuts: Sequence[int] = ()) -> torch.Tensor:
        """One request from scratch on one process -> float32 [vocab] logits of its last token.
        ``after_layer(n, h)`` sees the hidden states [T, hidden] after layer n (n = -1: the embeddings; the last
        chunk's rows with ``cuts``). ``tap``: the layers' decisions go through it for this call
        (``cpkv.engine.taps.Forced``: a verified run's own decisions; told each chunk's positions). ``cuts``: run
        the prompt as chunks [0, c1), [c1, c2), ..., each over the KV rows of those before (the same function at
        other row counts: the verification's numerics floor)."""
        if tap is not None:
            kept = self.tap
            self.set_tap(tap)
            try:
                return self.reference_prefill(tokens, after_layer, cuts=cuts)
            finally:
                self.set_tap(kept)
        n = len(tokens)
        ids = torch.tensor(list(tokens), dtype=torch.int64, device=self.device)
        bounds = [0, *[c for c in cuts if 0 < c < n], n]
        kept_rows: list[dict[str, torch.Tensor]] = [{} for _ in self.layers]  # the chunks' KV rows, per layer
        for s, e in zip(bounds, bounds[1:]):
            if self.tap is not None and hasattr(self.tap, "window"):
                self.tap.window(s, e)
            rot = self.rotary(torch.arange(s, e, device=self.device))
            plan = AttnPlan.build([0] * (e - s), list(range(s + 1, e + 1)), self.cfg.index_topk, self.device)
            h, delta, topk = self.embed(ids[s:e]), None, None  # delta: the last layer's MLP output, not yet added
            if after_layer is not None and e == n:
                after_layer(-1, h)
            for i, layer in enumerate(self.layers):
                p = layer.project(h, rot, delta)
                dense = {}
                for kind in ("token", "index"):
                    rows = getattr(p, kind)
                    if rows is not None:
                        before = kept_rows[i].get(kind)
                        dense[kind] = kept_rows[i][kind] = rows if before is None else torch.cat((before, rows))
                h, delta, topk = layer.attend_split(p.h, p, dense, plan, topk)
                if after_layer is not None and e == n:
                    after_layer(i, h + delta)
        return self.logits(h[-1:], None if delta is None else delta[-1:])[0]


def load_model(spec: str, *, seed: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
               num_layers: int | None = None, precision: str = "fp8", weights: str = "bf16",
               ep: tuple[int, int] | None = None, routed_experts: int | None = None,
               backends: Backends | None = None) -> DSAModel:
    """``spec``: a preset (random weights from ``seed``) or a checkpoint directory (config.json + safetensors).
    ``precision``: fp8 KV rows, or ``exact`` (rows, indexer keys and queries in the compute dtype).
    ``weights``: fp8 (linear weights block-scaled fp8), bf16 (widened to the compute dtype) or auto
    (``model.config.resolve_weights``). ``ep``: (rank, cp): hold (and read) only that rank's block of the
    routed experts. ``routed_experts``: route over that many experts per MoE layer (a preset's rank share on one
    GPU: ``ModelConfig.with_experts``). ``backends``: the kernels it runs (None: resolved from the device and the
    environment now)."""
    from cpkv.model.config import load_model_config, resolve_weights
    from cpkv.model.moe import expert_block

    dtype = dtype or default_dtype(device)
    cfg = precision_config(load_model_config(spec, num_layers, routed_experts), precision, dtype)
    fp8 = resolve_weights(weights, spec, torch.device(device).type, precision) == "fp8"
    experts = expert_block(ep[0], ep[1], cfg.n_routed_experts) if ep is not None else None
    from cpkv.config import model_source

    if model_source(spec)[0] == "dir":  # the same decision as load_model_config's
        return DSAModel.from_pretrained(spec, cfg, device, dtype, experts, fp8=fp8, backends=backends)
    return DSAModel.random(cfg, seed, device, dtype, experts, fp8=fp8, backends=backends)

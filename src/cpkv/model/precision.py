"""A layer's precision path, chosen once when the layer is built (``precision_for``), with one small interface:

    query_dtype                                          the absorbed query's dtype
    add_norm(h, delta, weight, eps, reader)              -> (h + delta, x = RMSNorm(h + delta), x as reader's input)
    token_rows(kv [T, kv_lora + rope], norm_weight, rot) -> uint8 token rows [T, token row_bytes]
    rope_query(rot, q_rope [T, H, rope], out)            the query's rope part rotated into ``out`` (a slice)
    index_inputs(x, q, k, k_norm, weights_proj, rot)     -> (iq [T, Hi, Di], iw float32 [T, Hi], uint8 index rows)
    dense_kv(token_dense uint8 [S, row])                 -> [S, kv_lora + rope] the attention reads
    dense_mla(q, kv, ks, ke, sm_scale, d_v)              -> latent [T, H, d_v]   (every visible key)
    sparse_mla(q, kv, topk, sm_scale, d_v)               -> latent [T, H, d_v]   (the selected keys)
    select(iq, iw, index_dense, plan)                    -> int32 [T, topk] absolute dense rows (-1 none)
    route(x, gate, bias)                                 -> (expert ids int64 [T, k], weights float32 [T, k])
    experts(x, idx, weights, ew, xq, add)                -> the routed experts' output [T, hidden]

``FP8Precision`` (the default): fp8 rows (656 / 132 B for GLM-5) through the dispatch points with the layer's
backends: add + norm + quantisation in one pass, token and index rows from their projections, Hadamard-rotated
indexer q / k (as the DeepSeek reference, for the fp8 quantisation), sparse MLA and the indexer's kernels.
``ExactPrecision`` (``--precision exact``): rows, indexer keys and queries in the model dtype
(``cpkv.model.exact``), torch's separate ops, the attention and top-k references.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from cpkv.config import ModelConfig
from cpkv.kernels.platform import Backends
from cpkv.model.experts import ExpertWeights
from cpkv.model.linear import Linear
from cpkv.model.ops import Rotary, add_rms_norm, layer_norm, rms_norm

LATENT_NORM_EPS = 1e-6  # the q_a / kv_a RMSNorms' eps (transformers hard-codes it)


class FP8Precision:
    """fp8 rows and the fused kernels (module docstring)."""

    exact = False
    query_dtype = torch.bfloat16

    def __init__(self, cfg: ModelConfig, backends: Backends) -> None:
        self.cfg, self.backends = cfg, backends

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 reader: Linear | None):
        """The add, the norm and (when ``reader`` quantises its input) the quantisation in one kernel."""
        quant = reader is not None and reader.quantises(h)
        h, x, qa = add_rms_norm(h, delta, weight, eps, quant, self.backends)
        return h, x, qa if qa is not None else x

    def token_rows(self, kv: torch.Tensor, norm_weight: torch.Tensor, rot: Rotary) -> torch.Tensor:
        """``cpkv.attention.token_rows``: norm, RoPE and quantisation (one kernel with Triton)."""
        from cpkv.attention import token_rows

        return token_rows(kv, norm_weight, rot.cos, rot.sin, LATENT_NORM_EPS, self.cfg.token_format, self.backends)

    def rope_query(self, rot: Rotary, q_rope: torch.Tensor, out: torch.Tensor) -> None:
        rot.interleaved_into(q_rope, out, self.backends)

    def index_inputs(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, k_norm: tuple[torch.Tensor, torch.Tensor],
                     weights_proj: torch.Tensor, rot: Rotary):
        """LayerNorm (keys), RoPE on the first dims, Hadamard rotation and quantisation: one kernel each with
        Triton; the head weights from x without a float32 copy of it."""
        from cpkv.indexer import head_weights, prepare_index_keys, prepare_index_queries

        cfg, b = self.cfg, self.backends
        weights = head_weights(x, weights_proj, cfg.index_n_heads ** -0.5, b)
        r, turn = cfg.qk_rope_head_dim, cfg.indexer_rope == "interleaved"
        iq, iw = prepare_index_queries(q, weights * cfg.index_head_dim ** -0.5, rot.cos, rot.sin, r, turn, b)
        return iq, iw, prepare_index_keys(k, *k_norm, rot.cos, rot.sin, r, turn, backends=b)

    def dense_kv(self, token_dense: torch.Tensor) -> torch.Tensor:
        from cpkv.attention import dequant_token_kv

        return dequant_token_kv(token_dense, self.cfg.token_format, self.backends)

    def dense_mla(self, q, kv, ks, ke, sm_scale: float, d_v: int) -> torch.Tensor:
        from cpkv.attention import dense_causal_mla

        return dense_causal_mla(q, kv, ks, ke, sm_scale, d_v, self.backends)[0]

    def sparse_mla(self, q, kv, topk, sm_scale: float, d_v: int) -> torch.Tensor:
        from cpkv.attention import sparse_mla

        return sparse_mla(q, kv, topk, sm_scale, d_v, self.backends)[0]

    def select(self, iq, iw, index_dense: torch.Tensor, plan) -> torch.Tensor:
        """The indexer's top-k over the fp8 index rows, in the plan's chunks."""
        from cpkv.indexer import dequantize_index_rows, index_topk

        k_fp8, k_scale = dequantize_index_rows(index_dense)
        return index_topk(iq, k_fp8, k_scale, iw, plan.ks, plan.ke, topk=plan.topk, plan=plan.indexer,
                          absolute=True, backends=self.backends)

    def route(self, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor):
        from cpkv.model.moe import route_choices

        return route_choices(x, gate, bias, self.cfg, fused=True, backends=self.backends)

    def experts(self, x, idx, weights, ew: ExpertWeights, xq, add) -> torch.Tensor:
        from cpkv.model.moe import experts

        return experts(x, idx, weights, ew, xq=xq, add=add, fused=True)


class ExactPrecision:
    """``--precision exact``: unquantised rows and torch's separate ops (module docstring)."""

    exact = True

    def __init__(self, cfg: ModelConfig, backends: Backends) -> None:
        from cpkv.model.exact import TORCH_DTYPES

        self.cfg, self.backends = cfg, backends
        self.query_dtype = TORCH_DTYPES[cfg.kv_dtype]  # the KV dtype (= the compute dtype)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                 reader: Linear | None):
        """torch's separate add, norm and (fp8 weights) quantisation."""
        h = h if delta is None else h + delta
        x = rms_norm(h, weight, eps)
        return h, x, reader.quantised_input(x) if reader is not None else x

    def token_kv(self, kv: torch.Tensor, norm_weight: torch.Tensor, rot: Rotary) -> torch.Tensor:
        """kv_a output [T, kv_lora + rope] -> [T, kv_lora + rope] in the compute dtype: RMSNorm'd latent | rotated
        rope key, each written into its slice (no float32 cat): the latent is rounded to the compute dtype by its
        norm, the rope key once from the float32 rotation."""
        kr = self.cfg.kv_lora_rank
        out = torch.empty(kv.shape, dtype=kv.dtype, device=kv.device)
        out[:, :kr] = rms_norm(kv[:, :kr], norm_weight, LATENT_NORM_EPS)
        rot.interleaved(kv[:, kr:], out=out[:, kr:])
        return out

    def token_rows(self, kv: torch.Tensor, norm_weight: torch.Tensor, rot: Rotary) -> torch.Tensor:
        from cpkv.model.exact import pack_rows

        return pack_rows(self.token_kv(kv, norm_weight, rot), self.cfg.token_format)

    def rope_query(self, rot: Rotary, q_rope: torch.Tensor, out: torch.Tensor) -> None:
        rot.interleaved(q_rope, out=out)

    def index_inputs(self, x: torch.Tensor, q: torch.Tensor, k: torch.Tensor, k_norm: tuple[torch.Tensor, torch.Tensor],
                     weights_proj: torch.Tensor, rot: Rotary):
        """transformers' indexer inputs in float32, no Hadamard rotation (it leaves dot products unchanged)."""
        from cpkv.model.exact import pack_rows

        weights = F.linear(x.float(), weights_proj.float()) * self.cfg.index_n_heads ** -0.5
        q, k = self.rope_first(q, rot), self.rope_first(layer_norm(k, *k_norm), rot)
        return q.to(self.query_dtype), weights, pack_rows(k, self.cfg.index_format)

    def rope_first(self, x: torch.Tensor, rot: Rotary) -> torch.Tensor:
        """Indexer q/k [..., Di]: the first ``qk_rope_head_dim`` dims rotate (interleaved or halves), the rest pass."""
        r = self.cfg.qk_rope_head_dim
        turn = rot.interleaved if self.cfg.indexer_rope == "interleaved" else rot.halves
        out = torch.empty(x.shape, dtype=torch.float32, device=x.device)
        out[..., r:] = x[..., r:]
        turn(x[..., :r], out=out[..., :r])
        return out

    def dense_kv(self, token_dense: torch.Tensor) -> torch.Tensor:
        from cpkv.model.exact import unpack_rows

        return unpack_rows(token_dense, self.cfg.token_format)

    def dense_mla(self, q, kv, ks, ke, sm_scale: float, d_v: int) -> torch.Tensor:
        from cpkv.attention import dense_causal_mla_ref

        return dense_causal_mla_ref(q, kv, ks, ke, sm_scale, d_v)[0]

    def sparse_mla(self, q, kv, topk, sm_scale: float, d_v: int) -> torch.Tensor:
        from cpkv.attention import sparse_mla_ref

        return sparse_mla_ref(q, kv, topk, sm_scale, d_v)[0]

    def select(self, iq, iw, index_dense: torch.Tensor, plan) -> torch.Tensor:
        """transformers' indexer formula over the exact keys, then the reference top-k."""
        from cpkv.model.exact import index_topk_exact, unpack_rows

        k = unpack_rows(index_dense, self.cfg.index_format)
        return index_topk_exact(iq, k, iw, plan.ks, plan.ke, plan.topk, self.cfg.index_head_dim ** -0.5)

    def route(self, x: torch.Tensor, gate: torch.Tensor, bias: torch.Tensor):
        from cpkv.model.moe import route_choices

        return route_choices(x, gate, bias, self.cfg, fused=False)

    def experts(self, x, idx, weights, ew: ExpertWeights, xq, add) -> torch.Tensor:
        from cpkv.model.moe import experts

        return experts(x, idx, weights, ew, xq=xq, add=add, fused=False)


PRECISION_PATHS: dict[str, Any] = {"fp8": FP8Precision, "exact": ExactPrecision}


def precision_for(cfg: ModelConfig, backends: Backends) -> FP8Precision | ExactPrecision:
    """The path of ``cfg.kv_dtype``: fp8 rows, or exact rows in the model dtype (float32 / bfloat16)."""
    return PRECISION_PATHS["fp8" if cfg.kv_dtype == "fp8" else "exact"](cfg, backends)

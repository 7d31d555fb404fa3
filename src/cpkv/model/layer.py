"""One DSA decoder layer, decomposed so that a CP rank can run it around the per-layer compose.

    project(h, rotary)                     h [T, hidden] (a rank's own query tokens)
        -> Projected: q     bf16 [T, H, kv_lora + rope]   absorbed MLA query (latent | rotated rope)
                      token uint8 [T, token row_bytes]   quantised latent KV + rope key (quant_token_kv)
                      index uint8 [T, Di + 4]            fp8 indexer key + scale (quantize_index_keys)
                      iq    fp8 [T, Hi, Di], iw float32 [T, Hi]   indexer queries, weights (q scale folded)
    ... the rank writes ``token`` / ``index`` rows, compose builds the dense buffers of the batch ...
    attend(h, proj, token_dense, index_dense, plan) -> h' [T, hidden]
        indexer top-k over index_dense rows [ks, ke) (or every key when each row sees <= top-k),
        sparse MLA over token_dense, W_UV and o_proj, residual, RMSNorm + SwiGLU MLP, residual.

Absorbed MLA (DeepSeek-V3 / GLM-5): kv_b_proj [H*(nope+v), kv_lora] splits into W_UK [H, nope, kv_lora]
and W_UV [H, v, kv_lora]; scores are q_nope W_UK . c + q_rope . k_rope over kv_lora + rope dims,
softmax scale (nope + rope)^-1/2; the output latent [T, H, kv_lora] maps back through W_UV.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from cpkv.config import ModelConfig
from cpkv.model.ops import Rotary, hadamard_rotate, layer_norm, rms_norm, swiglu_mlp


@dataclass
class Projected:
    """A rank's per-layer products for its own query tokens (see the module docstring)."""

    q: torch.Tensor
    token: torch.Tensor
    index: torch.Tensor
    iq: torch.Tensor
    iw: torch.Tensor


@dataclass
class AttnPlan:
    """Per batch and rank: dense-buffer key ranges of the rank's query tokens, built once, used by every layer.

    ks/ke int32 [T] on the device; ``max_keys`` = max(ke - ks), read from host lists. ``dense`` is True
    when every row sees <= top-k keys (the indexer is skipped: every visible key is selected).
    ``indexer``: the indexer's chunk plan (cpkv.indexer.IndexerPlan) for the sparse path.
    """

    ks: torch.Tensor
    ke: torch.Tensor
    max_keys: int
    topk: int
    indexer: Any = None

    @property
    def dense(self) -> bool:
        return self.max_keys <= self.topk

    @classmethod
    def build(cls, ks: list[int], ke: list[int], topk: int, device: torch.device | str,
              chunk_max_bytes: int | None = None) -> "AttnPlan":
        from cpkv.indexer import IndexerPlan

        ip = IndexerPlan.from_bounds(ks, ke, device, chunk_max_bytes)
        return cls(ip.ks, ip.ke, ip.max_len, topk, ip)


class DSALayer:
    """Weights of layer ``n`` (public names under ``model.layers.n.``) and its two halves."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], n: int) -> None:
        self.cfg, self.n = cfg, n
        w = {k[len(f"model.layers.{n}."):]: v for k, v in weights.items() if k.startswith(f"model.layers.{n}.")}
        self.w = w
        h, nope, v, kr = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        kv_b = w["self_attn.kv_b_proj.weight"].view(h, nope + v, kr)
        self.w_uk = kv_b[:, :nope].contiguous()  # [H, nope, kv_lora]
        self.w_uv = kv_b[:, nope:].contiguous()  # [H, v, kv_lora]
        self.sm_scale = (nope + cfg.qk_rope_head_dim) ** -0.5
        self.stats = {"dense": 0, "sparse": 0}

    # -- half 1: the rank's own tokens -> query, KV rows, indexer inputs ---------------------------
    def project(self, h: torch.Tensor, rot: Rotary) -> Projected:
        """h [T, hidden] (compute dtype) -> Projected (module docstring)."""
        from cpkv.attention import quant_token_kv

        cfg, w = self.cfg, self.w
        x = rms_norm(h, w["input_layernorm.weight"], cfg.rms_norm_eps)
        qr = rms_norm(F.linear(x, w["self_attn.q_a_proj.weight"]), w["self_attn.q_a_layernorm.weight"],
                      cfg.rms_norm_eps)
        kv = F.linear(x, w["self_attn.kv_a_proj_with_mqa.weight"])
        latent = rms_norm(kv[:, : cfg.kv_lora_rank], w["self_attn.kv_a_layernorm.weight"], cfg.rms_norm_eps)
        k_rope = rot.interleaved(kv[:, cfg.kv_lora_rank:])
        token = quant_token_kv(torch.cat((latent.float(), k_rope), dim=1), cfg.token_format)
        iq, iw, index = self._indexer_inputs(x, qr, rot)
        return Projected(self._query(qr, rot), token, index, iq, iw)

    def _query(self, qr: torch.Tensor, rot: Rotary) -> torch.Tensor:
        """qr [T, q_lora] -> absorbed query bf16 [T, H, kv_lora + rope]."""
        cfg = self.cfg
        q = F.linear(qr, self.w["self_attn.q_b_proj.weight"]).view(
            qr.shape[0], cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        q_lat = torch.einsum("thn,hnc->thc", q_nope, self.w_uk)
        # = cat((q_lat.float(), rope), -1).to(bf16) bit for bit, without a float32 [T, H, 576] pass
        return torch.cat((q_lat.to(torch.bfloat16), rot.interleaved(q_rope).to(torch.bfloat16)), dim=-1)

    def _indexer_inputs(self, x: torch.Tensor, qr: torch.Tensor, rot: Rotary):
        """-> (iq fp8 [T, Hi, Di], iw float32 [T, Hi], index rows uint8 [T, Di + 4])."""
        from cpkv.indexer import quantize_index_keys, quantize_queries

        cfg, w = self.cfg, self.w
        t, hi, di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
        q = F.linear(qr, w["self_attn.indexer.wq_b.weight"]).view(t, hi, di)
        k = layer_norm(F.linear(x, w["self_attn.indexer.wk.weight"]), w["self_attn.indexer.k_norm.weight"],
                       w["self_attn.indexer.k_norm.bias"])
        q, k = hadamard_rotate(self._rope_first(q, rot)), hadamard_rotate(self._rope_first(k, rot))
        weights = F.linear(x.float(), w["self_attn.indexer.weights_proj.weight"].float())
        weights = weights * (hi ** -0.5 * di ** -0.5)
        iq, iw = quantize_queries(q, weights)
        return iq, iw, quantize_index_keys(k)

    def _rope_first(self, x: torch.Tensor, rot: Rotary) -> torch.Tensor:
        """Indexer q/k [..., Di]: the first ``qk_rope_head_dim`` dims rotate (halves), the rest pass."""
        r = self.cfg.qk_rope_head_dim
        return torch.cat((rot.halves(x[..., :r]), x[..., r:].float()), dim=-1)

    # -- half 2: over the composed dense buffers ---------------------------------------------------
    def attend(self, h: torch.Tensor, p: Projected, token_dense: torch.Tensor, index_dense: torch.Tensor,
               plan: AttnPlan) -> torch.Tensor:
        """h [T, hidden]; token_dense uint8 [S, token row]; index_dense uint8 [S, Di + 4] -> h' [T, hidden]."""
        from cpkv.attention import dequant_token_kv

        kv = dequant_token_kv(token_dense, self.cfg.token_format)
        latent = self._attention(p, kv, index_dense, plan)  # bf16 [T, H, kv_lora]
        o = torch.einsum("thc,hvc->thv", latent.to(h.dtype), self.w_uv).reshape(h.shape[0], -1)
        h = h + F.linear(o, self.w["self_attn.o_proj.weight"])
        return h + self._mlp(h)

    def _attention(self, p: Projected, kv: torch.Tensor, index_dense: torch.Tensor, plan: AttnPlan) -> torch.Tensor:
        from cpkv.attention import dense_causal_mla, sparse_mla

        kr = self.cfg.kv_lora_rank
        if plan.dense:
            self.stats["dense"] += 1
            return dense_causal_mla(p.q, kv, plan.ks, plan.ke, self.sm_scale, kr)[0]
        self.stats["sparse"] += 1
        return sparse_mla(p.q, kv, self.select(p, index_dense, plan), self.sm_scale, kr)[0]

    def select(self, p: Projected, index_dense: torch.Tensor, plan: AttnPlan) -> torch.Tensor:
        """Indexer top-k: int32 [T, topk] absolute dense rows (-1 none) of each query's selected keys."""
        from cpkv.indexer import dequantize_index_rows, index_topk, topk_to_slots

        k_fp8, k_scale = dequantize_index_rows(index_dense)
        rel = index_topk(p.iq, k_fp8, k_scale, p.iw, plan.ks, plan.ke, topk=plan.topk, plan=plan.indexer)
        return topk_to_slots(rel, plan.ks)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        w = self.w
        x = rms_norm(h, w["post_attention_layernorm.weight"], self.cfg.rms_norm_eps)
        return swiglu_mlp(x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])

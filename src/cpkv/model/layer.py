"""One DSA decoder layer, decomposed so that a CP rank can run it around the per-layer compose.

    project(h, rotary, delta)              h [T, hidden] (a rank's own query tokens), delta: the previous
                                           layer's MLP output not yet added (None: h is the layer's input)
        -> Projected: h     [T, hidden]               the layer's input h + delta (added in its norm)
                      q     [T, H, kv_lora + rope]    absorbed MLA query (latent | rotated rope)
                      token uint8 [T, token row_bytes]  latent KV + rope key (fp8: attention.token_rows)
                      index uint8 [T, index row_bytes]  indexer key (fp8: indexer.prepare_index_keys); None on a
                                                        shared layer, which keeps no index rows
                      iq [T, Hi, Di], iw float32 [T, Hi]  indexer queries and head weights (full layers)
    ... the rank writes the layer's kinds of rows, compose builds the batch's dense buffers ...
    attend(h, proj, dense, plan, topk) -> (h' [T, hidden], topk)
    attend_split(...) -> (h + attention [T, hidden], the MLP's output [T, hidden], topk): the MLP's output
        not added, for the next layer's ``project`` to add in its fused norm (the model loops run this form)
        full layer: indexer top-k over dense["index"] rows [ks, ke) (or every key when each row sees
        <= top-k); shared layer: the previous full layer's ``topk`` (dense rows of the same batch);
        sparse MLA over dense["token"], W_UV and o_proj, residual; RMSNorm + dense SwiGLU MLP or MoE
        (``cpkv.model.moe``), residual.

Each residual add runs with the RMSNorm after it and the fp8 quantisation of the normed rows
(``cpkv.model.ops.add_rms_norm``: one Triton kernel where the backends run Triton): h + o_proj(...) with the post-attention norm,
h + mlp(...) with the next layer's input norm; the quantised rows feed every fp8 Linear reading them.

Absorbed MLA (DeepSeek-V3 / GLM-5): kv_b_proj [H*(nope+v), kv_lora] splits into W_UK [H, nope, kv_lora]
and W_UV [H, v, kv_lora]; scores are q_nope W_UK . c + q_rope . k_rope over kv_lora + rope dims with
transformers' softmax scale ((nope + rope)^-1/2, times YaRN's mscale_all_dim correction squared); the output
latent [T, H, kv_lora] maps back through W_UV. The indexer as transformers': q from the query latent,
k = LayerNorm(wk x), RoPE on the first rope dims (interleaved on GLM-5, halves on DeepSeek-V3.2), head
weights weights_proj(x) * Hi^-1/2, logits sum_h w_h relu(q_h . k * Di^-1/2). q_a / kv_a RMSNorms use
eps 1e-6 (transformers hard-codes it), the layer norms ``rms_norm_eps``.

Linear weights are ``cpkv.model.linear.Linear``: the compute dtype, or fp8 with 128 x 128 block scales
(block-scaled fp8 GEMMs; each input quantised once for the layers that read it). kv_b_proj is always dense
(W_UK / W_UV); gate and up projections are stacked into one [2I, D] weight (views of it replace the dict's
entries), the routed experts into ``ExpertWeights``.

Precision (``cfg.kv_dtype``): the layer's ``precision`` path, chosen once when it is built
(``cpkv.model.precision``): fp8 rows through the fused kernels, or exact rows in the model dtype. The kernels run
with the backends the layer is given (``cpkv.kernels.platform.Backends``: the model's, resolved at its load).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from cpkv.config import ModelConfig
from cpkv.kernels.platform import Backends, backends_for
from cpkv.model.experts import ExpertWeights
from cpkv.model.linear import Linear, QuantAct, swiglu
from cpkv.model.ops import Rotary, softmax_scale
from cpkv.model.precision import LATENT_NORM_EPS, precision_for
from cpkv.timeline import mark

LINEARS = ("self_attn.q_a_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.q_b_proj", "self_attn.o_proj",
           "self_attn.indexer.wq_b", "self_attn.indexer.wk")  # the attention's Linear sites (MLPs: _swiglu)


@dataclass
class Projected:
    """A rank's per-layer products for its own query tokens (see the module docstring)."""

    q: torch.Tensor
    token: torch.Tensor
    index: torch.Tensor | None
    iq: torch.Tensor | None
    iw: torch.Tensor | None
    h: torch.Tensor | None = None


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
    """Weights of layer ``n`` (public names under ``model.layers.n.``) and its two halves. ``backends``: the
    kernels it runs (None: ``backends_for`` its weights' device); its ``precision`` path is chosen here."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, torch.Tensor], n: int,
                 experts: range | None = None, backends: Backends | None = None) -> None:
        self.cfg, self.n = cfg, n
        self.experts = range(cfg.n_routed_experts) if experts is None else experts  # the routed experts held here
        w = {k[len(f"model.layers.{n}."):]: v for k, v in weights.items() if k.startswith(f"model.layers.{n}.")}
        self.w = w
        self.backends = backends or backends_for(w["input_layernorm.weight"].device)
        self.precision = precision_for(cfg, self.backends)
        self.exact = self.precision.exact
        self.full = cfg.indexer_types[n] == "full"
        h, nope, v, kr = cfg.num_heads, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.kv_lora_rank
        self.lin = {k: _linear(w, k, self.backends) for k in LINEARS if k + ".weight" in w}
        kv_b = w["self_attn.kv_b_proj.weight"].view(h, nope + v, kr)
        self.w_uk = kv_b[:, :nope].contiguous()  # [H, nope, kv_lora]
        self.w_uv = kv_b[:, nope:].contiguous()  # [H, v, kv_lora]
        self.sm_scale = softmax_scale(cfg.rope, nope + cfg.qk_rope_head_dim)
        sparse = cfg.mlp_layer_types[n] == "sparse"
        self.moe = _stack_experts(w, self.experts, self.backends) if sparse else None
        # (gate_up, down) of the dense MLP / the shared experts
        pre = f"model.layers.{n}."
        self.dense_mlp = _stacked_mlp(w, weights, pre, "mlp.", self.backends) if not sparse else None
        shared = sparse and cfg.n_shared_experts
        self.shared_mlp = _stacked_mlp(w, weights, pre, "mlp.shared_experts.", self.backends) if shared else None
        self.stats = {"dense": 0, "sparse": 0}
        self.routed: torch.Tensor | None = None  # a MoE layer's last routing, int [T, top-k] (``_route``)
        # its choice values, float32 [T, E], kept only while ``keep_choice`` (a graphed decode step keeping its
        # decisions: ``engine.decode_graph.step_forward``; a prefill chunk's would hold T x E floats per layer)
        self.route_choice: torch.Tensor | None = None
        self.keep_choice = False
        # the layer's discrete decisions go through ``tap`` when set (cpkv.engine.taps: recorded by a verified run,
        # forced on the reference that checks it, a planted fault in tests); None: decided here
        self.tap: Any = None

    # -- half 1: the rank's own tokens -> query, KV rows, indexer inputs ---------------------------
    def project(self, h: torch.Tensor, rot: Rotary, delta: torch.Tensor | None = None,
                q_out: torch.Tensor | None = None) -> Projected:
        """h [T, hidden] (compute dtype), delta [T, hidden] or None (the previous layer's MLP output, not yet
        added) -> Projected (module docstring). ``q_out``: where to write the query (``_query``), else new."""
        lin = self.lin
        # x quantised once (fp8) for q_a, kv_a and the indexer's wk, in the add + norm kernel
        h, x, xa = self._add_norm(h, delta, "input_layernorm.weight", lin["self_attn.q_a_proj"])
        # the query latent, normed and quantised once (fp8) for q_b and the indexer's wq_b in one kernel
        qa = self._add_norm(lin["self_attn.q_a_proj"](xa), None, "self_attn.q_a_layernorm.weight",
                            lin["self_attn.q_b_proj"], LATENT_NORM_EPS)[2]
        token = self.precision.token_rows(lin["self_attn.kv_a_proj_with_mqa"](xa),
                                          self.w["self_attn.kv_a_layernorm.weight"], rot)
        if not self.full:
            return Projected(self._query(qa, rot, q_out), token, None, None, None, h)
        iq, iw, index = self._indexer_inputs(x, xa, qa, rot)
        return Projected(self._query(qa, rot, q_out), token, index, iq, iw, h)

    def _add_norm(self, h: torch.Tensor, delta: torch.Tensor | None, norm: str, reader: Linear | None,
                  eps: float | None = None):
        """(h + delta, x = RMSNorm(h + delta) with weight ``norm`` (eps: the layer norms' by default), x as the
        input of ``reader``: its QuantAct when ``reader`` quantises its input (made with the norm), else x)."""
        eps = self.cfg.rms_norm_eps if eps is None else eps
        return self.precision.add_norm(h, delta, self.w[norm], eps, reader)

    @property
    def query_dtype(self) -> torch.dtype:
        """The absorbed query's dtype: bfloat16 (fp8 precision) or the KV dtype (exact)."""
        return self.precision.query_dtype

    def _query(self, qr, rot: Rotary, out: torch.Tensor | None = None) -> torch.Tensor:
        """qr [T, q_lora] (or its QuantAct) -> absorbed query [T, H, kv_lora + rope]: bf16 (fp8 precision) or
        the KV dtype (written into ``out`` when given: a contiguous tensor of that shape and dtype)."""
        cfg = self.cfg
        q = self.lin["self_attn.q_b_proj"](qr)
        q = q.view(q.shape[0], cfg.num_heads, cfg.qk_nope_head_dim + cfg.qk_rope_head_dim)
        q_nope, q_rope = q[..., : cfg.qk_nope_head_dim], q[..., cfg.qk_nope_head_dim:]
        # out = cat((q_nope W_UK, rope(q_rope)), -1) in the query dtype, each part written into its slice:
        # the absorbed product straight from the batched GEMM (when dtypes match), the rotation rounded once
        kr = cfg.kv_lora_rank
        dtype = self.query_dtype
        shape = (q.shape[0], cfg.num_heads, kr + cfg.qk_rope_head_dim)
        if out is None:
            out = torch.empty(shape, dtype=dtype, device=q.device)
        elif out.shape != shape or out.dtype != dtype or not out.is_contiguous():
            raise ValueError(f"q_out must be a contiguous {dtype} tensor of shape {shape}, got {out.dtype} "
                             f"{tuple(out.shape)}")
        lat = out[..., :kr]
        if dtype == q.dtype:
            torch.bmm(q_nope.transpose(0, 1), self.w_uk, out=lat.transpose(0, 1))
        else:
            lat.copy_(torch.einsum("thn,hnc->thc", q_nope, self.w_uk))
        self.precision.rope_query(rot, q_rope, out[..., kr:])
        return out

    def _indexer_inputs(self, x: torch.Tensor, xa, qa, rot: Rotary):
        """x [T, hidden] (xa: x or its QuantAct), qa: the query latent or its QuantAct -> (iq [T, Hi, Di],
        iw float32 [T, Hi], index rows uint8 [T, index row_bytes])."""
        cfg, w, lin = self.cfg, self.w, self.lin
        t, hi, di = x.shape[0], cfg.index_n_heads, cfg.index_head_dim
        q = lin["self_attn.indexer.wq_b"](qa).view(t, hi, di)
        k = lin["self_attn.indexer.wk"](xa)
        k_norm = (w["self_attn.indexer.k_norm.weight"], w["self_attn.indexer.k_norm.bias"])
        return self.precision.index_inputs(x, q, k, k_norm, w["self_attn.indexer.weights_proj.weight"], rot)

    # -- half 2: over the composed dense buffers ---------------------------------------------------
    def attend(self, h: torch.Tensor, p: Projected, dense: dict[str, torch.Tensor], plan: AttnPlan,
               topk: torch.Tensor | None = None, ep: Any = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """h [T, hidden]; dense {"token": uint8 [S, token row], "index": uint8 [S, index row] (full layers)};
        ``topk``: the previous full layer's selection (shared layers) -> (h' [T, hidden], this layer's topk).
        ``ep``: the batch's expert-parallel exchange (``mlp``)."""
        h, out, topk = self.attend_split(h, p, dense, plan, topk, ep)
        return h + out, topk

    def attend_split(self, h: torch.Tensor, p: Projected, dense: dict[str, torch.Tensor], plan: AttnPlan,
                     topk: torch.Tensor | None = None, ep: Any = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``attend`` without its last residual add -> (h + attention [T, hidden], the MLP's output [T, hidden],
        topk); h + MLP output is the layer's output (the next layer's ``project`` adds it in its norm)."""
        latent, topk = self.attention(p, dense, plan, topk)
        h, out = self.finish(h, latent, ep)
        return h, out, topk

    def attention(self, p: Projected, dense: dict[str, torch.Tensor], plan: AttnPlan,
                  topk: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The part of ``attend_split`` that reads the composed keys -> (latent [T, H, kv_lora], topk)."""
        kv = self.precision.dense_kv(dense["token"])
        if not plan.dense and self.full:
            topk = self.select(p, dense["index"], plan)
            if self.tap is not None:
                topk = self.tap.select(self, p, dense["index"], plan, topk)
            mark(f"L{self.n} indexer")
        latent = self._attention(p, kv, topk, plan)  # [T, H, kv_lora]
        mark(f"L{self.n} attention")
        return latent, topk

    def finish(self, h: torch.Tensor, latent: torch.Tensor, ep: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rest of ``attend_split``, row by row over the rank's tokens: latent [T, H, kv_lora] through W_UV
        and o_proj, the residual add with the post-attention norm, the MLP -> (h + attention, the MLP's output)."""
        h, x, xa = self._post_attention(h, latent)
        out = self._mlp(x, xa, ep)
        mark(f"L{self.n} mlp")
        return h, out

    def finish_routed(self, h: torch.Tensor, latent: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """``finish`` of a MoE layer under expert parallelism up to its exchange, the part that is row by row
        over the rank's own tokens -> (h + attention, x (the normed rows the experts take), expert ids int64
        [T, k], routing weights float32 [T, k], the shared experts' output [T, hidden] or None); then
        ``finish_experts``."""
        h, x, xa = self._post_attention(h, latent)
        idx, weights, shared = self._route(x, xa)
        return h, x, idx, weights, shared

    def finish_experts(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, shared: torch.Tensor | None,
                       ep: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """The routed experts through the batch's exchange ``ep`` (every rank, every MoE layer), plus the shared
        experts' output -> the MLP's output [T, hidden] (written into ``out`` when given). Its caller marks the
        layer's MLP done."""
        from cpkv.model.moe import experts_ep

        y = experts_ep(x, idx, weights, self.moe, ep)
        if shared is not None:
            y = torch.add(y, shared, out=out) if out is not None else y + shared
        elif out is not None:
            y = out.copy_(y)
        return y if self.tap is None else self.tap.moe_out(self, y)

    def _post_attention(self, h: torch.Tensor, latent: torch.Tensor):
        o = self.lin["self_attn.o_proj"](self._latent_out(latent.to(h.dtype)))
        return self._add_norm(h, o, "post_attention_layernorm.weight", self._mlp_reader)

    def _latent_out(self, latent: torch.Tensor) -> torch.Tensor:
        """latent [T, H, kv_lora] -> o [T, H * v] = einsum("thc,hvc->thv", latent, W_UV), the batched GEMM
        writing [T, H, v] in place (the einsum's [H, T, v] result would be copied again by the reshape)."""
        t, cfg = latent.shape[0], self.cfg
        o = torch.empty(t, cfg.num_heads, cfg.v_head_dim, dtype=latent.dtype, device=latent.device)
        torch.bmm(latent.transpose(0, 1), self.w_uv.transpose(1, 2), out=o.transpose(0, 1))
        return o.view(t, -1)

    def _attention(self, p: Projected, kv: torch.Tensor, topk: torch.Tensor | None, plan: AttnPlan) -> torch.Tensor:
        kr = self.cfg.kv_lora_rank
        if plan.dense:
            self.stats["dense"] += 1
            return self.precision.dense_mla(p.q, kv, plan.ks, plan.ke, self.sm_scale, kr)
        if topk is None:
            raise ValueError(f"layer {self.n} is a shared indexer layer with no earlier full layer's top-k")
        self.stats["sparse"] += 1
        return self.precision.sparse_mla(p.q, kv, topk, self.sm_scale, kr)

    def select(self, p: Projected, index_dense: torch.Tensor, plan: AttnPlan) -> torch.Tensor:
        """Indexer top-k: int32 [T, topk] absolute dense rows (-1 none) of each query's selected keys."""
        return self.precision.select(p.iq, p.iw, index_dense, plan)

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    def mlp(self, h: torch.Tensor, ep: Any = None) -> torch.Tensor:
        """h [T, hidden] -> the MLP's output [T, hidden] (RMSNorm, then dense SwiGLU or MoE). With ``ep`` (the
        batch's ``cpkv.compose.dispatch.EPBatch``) the routed experts run where they live: every rank of the
        group must call it for every MoE layer, also with T = 0 (it serves its experts to the others)."""
        _, x, xa = self._add_norm(h, None, "post_attention_layernorm.weight", self._mlp_reader)
        return self._mlp(x, xa, ep)

    def _route(self, x: torch.Tensor, xa: Any):
        """A MoE layer's routing of x and its shared experts' output -> (idx, weights, shared or None)."""
        w = self.w
        if self.tap is not None:
            (idx, weights), choice = self.tap.route(self, x), None
        else:
            idx, weights, choice = self.precision.route(x, w["mlp.gate.weight"], w["mlp.gate.e_score_correction_bias"])
        self.routed = idx  # the last batch's choices, kept by reference (no copy, no sync; under a CUDA graph the
        # graph's own buffer, current after each replay): what a benchmark's floor counts after its step
        self.route_choice = choice if self.keep_choice else None
        shared = swiglu(xa, *self.shared_mlp) if self.shared_mlp is not None else None
        mark(f"L{self.n} route+shared")
        return idx, weights, shared

    @property
    def _mlp_reader(self) -> Linear | None:
        """The Linear whose quantisation decides the MLP's normed input's: the dense MLP's or the shared experts'
        gate_up (the routed experts, without expert parallelism, gather the same quantised rows per pair)."""
        pair = self.dense_mlp or self.shared_mlp
        return pair[0] if pair else None

    def _mlp(self, x: torch.Tensor, xa: Any, ep: Any = None) -> torch.Tensor:
        """x [T, hidden] (normed), xa: x or its QuantAct -> the MLP's output [T, hidden] (``mlp``)."""
        if self.moe is None:
            return swiglu(xa, *self.dense_mlp)
        idx, weights, shared = self._route(x, xa)
        if ep is not None:
            return self.finish_experts(x, idx, weights, shared, ep)
        if len(self.experts) != self.cfg.n_routed_experts:
            raise ValueError(f"layer {self.n} holds routed experts {self.experts.start}..{self.experts.stop - 1} of "
                             f"{self.cfg.n_routed_experts}: its MoE needs the expert-parallel exchange (ep)")
        # x's fp8 rows (made by the norm) gathered per pair; the shared experts' output added in the combine
        xq = (xa.q, xa.s) if isinstance(xa, QuantAct) else None
        y = self.precision.experts(x, idx, weights, self.moe, xq, shared)
        return y if self.tap is None else self.tap.moe_out(self, y)


def _stack(w: dict[str, torch.Tensor], prefixes: list[str], sfx: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Experts under ``prefixes``: (gate | up stacked [E, 2I, ...], down [E, ...]) of the tensors named
    ``<prefix>{gate,up,down}_proj.weight<sfx>``."""
    gate_up = torch.stack([torch.cat((w[q + "gate_proj.weight" + sfx], w[q + "up_proj.weight" + sfx]))
                           for q in prefixes])
    return gate_up, torch.stack([w[q + "down_proj.weight" + sfx] for q in prefixes])


def _linear(w: dict[str, torch.Tensor], name: str, backends: Backends) -> Linear:
    """``name`` (without ``.weight``) as a Linear: fp8 + its block scales when the dict holds them."""
    return Linear(w[name + ".weight"], w.get(name + ".weight_scale_inv"), backends)


def _stacked_mlp(w: dict[str, torch.Tensor], weights: dict[str, torch.Tensor], pre: str, prefix: str,
                 backends: Backends) -> tuple[Linear, Linear]:
    """(gate_up [2I, D], down [D, I]) of the MLP under ``prefix`` of a layer's weights ``w`` (the model's under
    ``pre + prefix``): gate and up stacked once, and the dict entries (the layer's and the model's) replaced by
    views of the stacked tensors (no second copy)."""
    dtype = w["input_layernorm.weight"].dtype  # the compute dtype
    gate, up = _linear(w, prefix + "gate_proj", backends), _linear(w, prefix + "up_proj", backends)
    gate_up = Linear.cat([gate, up]) or Linear(torch.cat((gate.dense(dtype), up.dense(dtype))), None, backends)
    i = gate.weight.shape[0]
    for k, part in (("gate_proj", slice(0, i)), ("up_proj", slice(i, 2 * i))):
        if gate_up.fp8 != gate.fp8:  # fp8 gate / up whose blocks do not stack: kept as they are
            break
        views = {k + ".weight": gate_up.weight[part]}
        if gate_up.fp8:
            views[k + ".weight_scale_inv"] = gate_up.scale[part.start // 128: -(-part.stop // 128)]
        for name, t in views.items():
            w[prefix + name] = weights[pre + prefix + name] = t
    return gate_up, _linear(w, prefix + "down_proj", backends)


def _stack_experts(w: dict[str, torch.Tensor], experts: range, backends: Backends) -> ExpertWeights:
    """The routed experts held here (all, or this rank's block under expert parallelism) as gate_up [E, 2I, D] and
    down [E, D, I], fp8 with their block scales when the experts are fp8 and I a multiple of 128 (else
    dequantised); the per-expert tensors are dropped from ``w``."""
    p = [f"mlp.experts.{x}." for x in experts]
    names = ("gate_proj.weight", "up_proj.weight", "down_proj.weight")
    fp8 = all(q + k + "_scale_inv" in w for q in p for k in names)
    if fp8 and w[p[0] + names[0]].shape[0] % 128 == 0:
        ew = ExpertWeights(*_stack(w, p, ""), *_stack(w, p, "_scale_inv"), backends=backends)
    elif fp8:
        dtype = w["input_layernorm.weight"].dtype
        dense = {q + k: _linear(w, q + k[:-7], backends).dense(dtype) for q in p for k in names}
        ew = ExpertWeights(*_stack(dense, p, ""), backends=backends)
    else:
        ew = ExpertWeights(*_stack(w, p, ""), backends=backends)
    for q in p:
        for k in names:
            w.pop(q + k)
            w.pop(q + k + "_scale_inv", None)
    return ew

"""Issue 42: what a rank's set-up holds, counted tensor by tensor on the CPU, beside the memory plan's terms.

    PYTHONPATH=src python benchmarks/plan_breakdown.py --layers 4 [--json]

Builds the model as a cp-1 rank does (``cpkv.model.load_model``: glm5, ``--experts`` routed experts, fp8 weights,
bf16 compute as on CUDA) at GLM-5's real dimensions but ``--layers`` deep, then counts every storage the model, its
layers, their Linear / ExpertWeights objects and (in a one-rank group on the CPU) the compose runtime's pool, staging
and arena hold, once each (views share their storage), per category. Each category's bytes are fitted per layer
kind (the layers' tensors depend only on (indexer type, MLP type): ``layer_kinds``) and extrapolated to
``--full-layers`` (78). Every tensor the garbage collector sees is summed too: ``unaccounted`` is what no category
claims (0 when the walk is complete). The plan's column: ``cpkv.memplan`` at the same setup.
Needs about 9 GB of RAM at 4 layers (the embeddings and head in bf16, one MoE layer's 32 experts in fp8).
"""
from __future__ import annotations

import argparse
import gc
import json
import sys
from collections import defaultdict

import torch

from cpkv.config import CPConfig, pool_caps
from cpkv.memplan import GB, Setup, items_at, weight_part, weight_parts
from cpkv.model.checkpoint import layer_kinds
from cpkv.model.config import load_model_config, with_precision
from cpkv.model.model import load_model


def storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def layer_category(key: str) -> str:
    """The plan's category of a layer tensor named ``key`` within its layer (``memplan.weight_part``); W_UK / W_UV
    (the layer's copies, no checkpoint name) with kv_b_proj."""
    return "mla_absorbed" if key in ("w_uk", "w_uv") else weight_part("model.layers.0." + key)


def count_model(model) -> tuple[dict[str, int], dict[int, dict[str, int]], set]:
    """(outer categories -> bytes, layer n -> {category: bytes}, the storages seen)."""
    seen: set = set()
    outer: dict[str, int] = defaultdict(int)

    def add(t: torch.Tensor | None, into: dict, cat: str) -> None:
        if t is None:
            return
        k = storage_key(t)
        if k not in seen:
            seen.add(k)
            into[cat] += k[1]

    per_layer: dict[int, dict[str, int]] = {}
    for n, layer in enumerate(model.layers):  # the layer's own objects first: stacked tensors, copies
        d: dict[str, int] = defaultdict(int)
        add(layer.w_uk, d, layer_category("w_uk"))
        add(layer.w_uv, d, layer_category("w_uv"))
        if layer.moe is not None:
            for f in ("gate_up", "down", "gate_up_scale", "down_scale"):
                add(getattr(layer.moe, f), d, "experts")
        for pair, cat in ((layer.dense_mlp, "dense_mlp"), (layer.shared_mlp, "shared_experts")):  # stacked gate_up
            for lin in pair or ():
                add(lin.weight, d, cat)
                add(lin.scale, d, cat)
        for key, lin in layer.lin.items():
            add(lin.weight, d, layer_category(key + ".weight"))
            add(lin.scale, d, layer_category(key + ".weight"))
        for key, t in layer.w.items():
            add(t, d, layer_category(key))
        per_layer[n] = dict(d)
    for name, t in model.weights.items():
        if name.startswith("model.layers."):
            n, key = int(name.split(".")[2]), name.split(".", 3)[3]
            add(t, per_layer.setdefault(n, {}), layer_category(key))  # nothing new when the walk above is complete
        else:
            add(t, outer, {"model.embed_tokens.weight": "embedding", "lm_head.weight": "lm_head"}.get(name, "norms"))
    return dict(outer), per_layer, seen


def all_tensor_bytes(seen: set) -> int:
    """Bytes of every CPU tensor storage the garbage collector reaches that ``seen`` does not hold."""
    extra: dict = {}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and obj.device.type == "cpu" and not obj.is_meta:
                k = storage_key(obj)
                if k not in seen and k[1]:
                    extra[k] = k[1]
        except Exception:  # noqa: BLE001 -- some objects refuse isinstance / attribute access
            continue
    return sum(extra.values())


def runtime_rank(ctx, model_cfg, pages: int, page_size: int, chunk: int, max_requests: int) -> dict[str, int]:
    """A one-rank group's compose runtime at this pool: bytes of its pool, staging and arena."""
    from cpkv.compose.runtime import ComposeRuntime

    caps = pool_caps(1, page_size, pages, chunk, max_requests)
    rt = ComposeRuntime.create(ctx, model_cfg, num_pages=pages, page_size=page_size, caps=caps)
    nb = lambda ts: sum(t.untyped_storage().nbytes() for t in ts)  # noqa: E731
    out = {"kv": nb(rt.pool.buffers.values()), "staging": nb(rt.staging.buffers.values()),
           "compose": nb([rt.arena.buffer])}
    rt.close()
    return out


def fit_layers(model_cfg, per_layer: dict[int, dict[str, int]], full_cfg) -> dict[str, int]:
    """Each category's bytes over ``full_cfg``'s layers: a layer of each kind counted once (the built model holds
    at least one layer of every kind the full model has, or the kind is missing and says so)."""
    by_kind: dict[tuple[str, str], dict[str, int]] = {}
    for n, d in per_layer.items():
        by_kind.setdefault((model_cfg.indexer_types[n], model_cfg.mlp_layer_types[n]), d)
    total: dict[str, int] = defaultdict(int)
    for first, count in layer_kinds(full_cfg).items():
        kind = (full_cfg.indexer_types[first], full_cfg.mlp_layer_types[first])
        if kind not in by_kind:
            raise SystemExit(f"the built model has no layer of kind {kind}: build more layers")
        for cat, b in by_kind[kind].items():
            total[cat] += count * b
    return dict(total)


def plan_parts(cfg, experts_per_rank: int) -> dict[str, int]:
    """The plan's weights split as the count is (``memplan.weight_parts``)."""
    return weight_parts(cfg, "fp8", "bfloat16", experts_per_rank)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=5, help="layers built (>= 5 holds every GLM-5 layer kind)")
    p.add_argument("--full-layers", type=int, default=78)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--pages", type=int, default=2048)
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--chunk-size", type=int, default=4096)
    p.add_argument("--max-requests", type=int, default=8)
    p.add_argument("--json", action="store_true")
    a = p.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    model = load_model("glm5", device="cpu", dtype=torch.bfloat16, num_layers=a.layers, precision="fp8",
                       weights="fp8", routed_experts=a.experts)
    gc.collect()
    outer, per_layer, seen = count_model(model)
    stray = all_tensor_bytes(seen)
    cfg = model.cfg
    full = with_precision(load_model_config("glm5", a.full_layers, a.experts), "fp8", "bfloat16")
    from cpkv.dist import launch

    rt = launch(runtime_rank, 1, args=(cfg, a.pages, a.page_size, a.chunk_size, a.max_requests))[0]
    rows = []
    for depth, c in ((a.layers, cfg), (a.full_layers, full)):
        counted = {**outer, **fit_layers(cfg, per_layer, c)}
        s = Setup(c, 1, 10**15, weights="fp8", compute="bfloat16", device="cuda", page_size=a.page_size,
                  chunk_size=a.chunk_size, max_requests=a.max_requests, pages_per_rank=a.pages)
        planned = plan_parts(c, s.experts_per_rank)
        items = items_at(s, a.pages)
        kv_scale = c.kv_bytes_per_token() / cfg.kv_bytes_per_token()  # exact: the pool is linear in its layers
        # the pool holds every layer's rows; staging and arena one layer's at a time (no depth in them)
        counted.update(kv=int(rt["kv"] * kv_scale), staging=rt["staging"], compose=rt["compose"])
        planned.update(kv=items["kv_bytes"], staging=items["staging_bytes"], compose=items["compose_bytes"])
        for cat in sorted(set(counted) | set(planned)):
            rows.append({"layers": depth, "category": cat, "plan_bytes": planned.get(cat, 0),
                         "counted_bytes": counted.get(cat, 0)})
    out = {"layers_built": a.layers, "experts": a.experts, "pages": a.pages, "chunk_size": a.chunk_size,
           "unaccounted_bytes": stray, "rows": rows}
    if a.json:
        json.dump(out, sys.stdout, indent=1)
        print()
        return 0
    print(f"glm5, {a.experts} routed experts, fp8 weights, bf16; built {a.layers} layers on the CPU; "
          f"tensors no category claims: {stray / GB:.3f} GB")
    print(f"{'layers':>6} {'category':<16} {'plan GB':>9} {'counted GB':>10} {'counted - plan':>14}")
    for r in rows:
        print(f"{r['layers']:>6} {r['category']:<16} {r['plan_bytes'] / GB:>9.3f} {r['counted_bytes'] / GB:>10.3f} "
              f"{(r['counted_bytes'] - r['plan_bytes']) / GB:>14.4f}")
    for depth in (a.layers, a.full_layers):
        tp = sum(r["plan_bytes"] for r in rows if r["layers"] == depth)
        tc = sum(r["counted_bytes"] for r in rows if r["layers"] == depth)
        print(f"{depth:>6} {'total':<16} {tp / GB:>9.3f} {tc / GB:>10.3f} {(tc - tp) / GB:>14.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

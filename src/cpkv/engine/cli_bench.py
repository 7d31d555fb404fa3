"""``cpkv bench engine``: prefill throughput of one long prompt through the whole CP engine.

Real GLM-5 shapes (64 heads, 576-dim absorbed scores, indexer 32 x 128, top-k 2048; its layer pattern: the
first ``--layers`` of 78, full and shared indexer layers, dense then MoE layers) with a few layers, a prompt of 32K tokens, cold and with a 90 % cached prefix (a parent request caches the
prefix first). Runs the engine twice in the same rank processes: the first pass warms kernels up, the
second is timed (per batch, device synchronised). Ceiling, measured in the same run: the bf16 GEMM
rate of this GPU; the ratio is the model FLOPs of a batch / its time against it.
"""
from __future__ import annotations

import argparse

HELP = "Prefill tokens/s of a long prompt through the CP engine, cold and with a cached prefix."


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli.args import positive_int

    p.add_argument("--model", default="glm5", help="preset or checkpoint dir (default glm5)")
    p.add_argument("--layers", type=positive_int, default=4, help="decoder layers (default 4)")
    p.add_argument("--prompt", type=positive_int, default=32768, help="prompt tokens (default 32768)")
    p.add_argument("--cached", type=float, default=0.9, help="cached share of the warm case (default 0.9)")
    p.add_argument("--cp", type=int, default=1, help="rank processes (default 1: the whole GPU)")
    p.add_argument("--mode", default="symm", help="compose mode (default symm)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--page-size", type=int, default=64)
    p.add_argument("--json", action="store_true")


def run(args: argparse.Namespace) -> int:
    from cpkv.cli.args import require_cuda
    from cpkv.cli.fmt import emit_json, table
    from cpkv.config import CPConfig
    from cpkv.engine.config import EngineConfig
    from cpkv.engine.engine import run_jobs
    from cpkv.errors import ConfigError
    from cpkv.model.config import load_model_config

    if not 0.0 <= args.cached < 1.0:
        raise ConfigError(f"--cached: expected a share in [0, 1), got {args.cached}")
    CPConfig(args.cp, args.page_size)  # validates cp and page_size before they size anything
    cfg_m = load_model_config(args.model, args.layers)
    P = args.page_size
    prefix = int(args.prompt * args.cached) // P * P
    trace = bench_trace(args.prompt, prefix)
    chunk = -(-args.prompt // P) * P
    pages = 2 * (-(-args.prompt // P)) + 8
    cfg = EngineConfig(model=args.model, num_layers=args.layers, cp=args.cp, mode=args.mode, device=args.device,
                       page_size=P, pages_per_rank=pages // args.cp + 8, chunk_size=chunk, max_requests=1)
    require_cuda(args.device, "cpkv bench engine")
    ceiling = gemm_tflops(args.device)
    warm, timed = run_jobs([(cfg, trace), (cfg, trace)], timeout_s=580)
    rows = [case_row(name, timed, rid, cfg_m, ceiling) for name, rid in (("cold", "cold"), ("cached", "hit"))]
    if args.json:
        emit_json({"model": cfg_m.name, "layers": args.layers, "indexer_layers": list(cfg_m.full_layers), "cp": args.cp, "mode": timed.stats["mode"],
                   "gemm_tflops": ceiling, "cases": rows})
        return 0
    table(("case", "prompt", "cached", "batch s", "prompt tok/s", "computed tok/s", "TFLOP/s", "of GEMM"),
          [(r["case"], r["prompt"], r["cached"], r["batch_s"], r["prompt_tokens_per_s"], r["computed_tokens_per_s"],
            r["tflops"], f"{r['ratio_to_gemm']:.1%}") for r in rows])
    moe = cfg_m.mlp_layer_types.count("sparse")
    print(f"\n{cfg_m.name} shapes, {args.layers} layers (indexer on {len(cfg_m.full_layers)}, MoE on {moe}), cp {args.cp} ({args.device}, mode {timed.stats['mode']}); "
          f"ceiling: GEMM {ceiling:.3g} TFLOP/s measured in this run")
    return 0


def bench_trace(prompt: int, prefix: int):
    """cold: a fresh prompt; base: the prefix alone (fills the cache); hit: base + the rest."""
    from cpkv.scheduler.trace import TraceRequest

    return [TraceRequest("cold", 0.0, prompt), TraceRequest("base", 0.0, prefix),
            TraceRequest("hit", 0.0, prompt, None, "base")]


def case_row(name: str, res, rid: str, cfg, ceiling: float) -> dict:
    log, times = res.stats["batch_log"], res.stats["batch_s"]
    i = next(k for k, b in enumerate(log) if b[0][0] == rid)
    _, prefix, extend, _, _ = log[i][0]
    secs = times[i]
    flops = prefill_flops(cfg, prefix, extend)
    return {"case": name, "prompt": prefix + extend, "cached": prefix, "batch_s": round(secs, 4),
            "prompt_tokens_per_s": round((prefix + extend) / secs, 1), "computed_tokens_per_s": round(extend / secs, 1),
            "tflops": round(flops / secs / 1e12, 1), "ratio_to_gemm": round(flops / secs / 1e12 / ceiling, 4)}


def prefill_flops(cfg, prefix: int, extend: int) -> float:
    """Model FLOPs of computing tokens [prefix, prefix + extend): linear layers (MoE: the routed experts a
    token runs plus the shared ones), the indexer on full indexer layers only, sparse attention."""
    d, h, qr, kr = cfg.hidden_size, cfg.num_heads, cfg.q_lora_rank, cfg.kv_lora_rank
    nope, rope, v, hi, di = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.index_n_heads, cfg.index_head_dim
    attn = d * qr + qr * h * (nope + rope) + d * (kr + rope) + h * nope * kr + h * kr * v + h * v * d
    moe = 3 * d * cfg.moe_intermediate_size * (cfg.num_experts_per_tok + cfg.n_shared_experts) + d * cfg.n_routed_experts
    mlp = {"dense": 3 * d * cfg.intermediate_size, "sparse": moe}
    seq = prefix + extend
    keys = (seq * (seq + 1) - prefix * (prefix + 1)) // 2          # sum of visible keys over the queries
    sparse = seq > cfg.index_topk
    attended = sum(min(p + 1, cfg.index_topk) for p in range(prefix, seq))
    total = 0
    for kind, full in zip(cfg.mlp_layer_types, (t == "full" for t in cfg.indexer_types)):
        linear = attn + mlp[kind] + ((qr * hi * di + d * di + d * hi) if full else 0)
        indexer = 2 * keys * hi * di if sparse and full else 0
        total += 2 * linear * extend + 2 * attended * h * (kr + rope + kr) + indexer
    return float(total)


def gemm_tflops(device: str) -> float:
    """bf16 (CUDA) / float32 (CPU) square GEMM rate, TFLOP/s."""
    import time

    import torch

    n, dtype = (8192, torch.bfloat16) if device == "cuda" else (1024, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    reps = 20 if device == "cuda" else 3
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    if device == "cuda":
        torch.cuda.synchronize()
    rate = 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12
    del a, b
    if device == "cuda":
        torch.cuda.empty_cache()
    return round(rate, 1)

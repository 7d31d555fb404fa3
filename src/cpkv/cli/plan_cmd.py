"""``cpkv plan``: the memory plan of a run, per rank and for the node, before anything loads.

    cpkv plan --model glm5 --cp 8                      # GLM-5-FP8 on 8 GPUs: what fits, KV tokens left
    cpkv plan --model ~/GLM-5-FP8 --cp 8 --json        # a checkpoint dir's config.json

Exit status 0 when it fits, 1 when not (the text names the largest item). ``check_run`` is ``cpkv run``'s
pre-check: a configuration that does not fit its GPUs (on CPU, the host's available memory) is one line
``cpkv run: error: ...`` naming the option to change, before any rank starts.
"""
from __future__ import annotations

import argparse

from cpkv.errors import ConfigError

HELP = "The memory plan of a run per rank (weights, expert shard, KV pool, buffers) and the KV tokens that fit."
DEFAULT_GPU_GB = 141.0  # an H200, when no GPU is visible
MAX_GPU_GB = 10_000.0   # --gpu-memory: 10 TB per GPU


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli import args as a
    from cpkv.engine.config import GRAPH_TOKENS
    from cpkv.config import DEFAULT_PAGE_SIZE, SIZES as PRESETS

    SIZES = PRESETS["model"]  # a real model on a GPU
    from cpkv.memplan import WEIGHTS

    p.add_argument("--model", required=True, help="preset (glm5, deepseek-v32, tiny) or checkpoint dir (config.json)")
    p.add_argument("--cp", type=a.sim_ranks, default=SIZES.cp,
                   help=f"ranks (one GPU each; default {SIZES.cp}, a node); the experts split over them")
    p.add_argument("--gpu-memory", type=a.bounded_float(0.0, MAX_GPU_GB), metavar="GB",
                   help=f"memory of one GPU in GB of 10^9 bytes (default: the visible GPU's, else {DEFAULT_GPU_GB:g})")
    p.add_argument("--weights", choices=WEIGHTS,
                   help="linear weights kept fp8 (block scales) or in bf16 (default: as the checkpoint ships them; "
                        "fp8 for the glm5 and deepseek-v32 presets)")
    p.add_argument("--precision", choices=("fp8", "exact"), default="fp8", help="KV rows fp8 (default) or exact (bf16)")
    p.add_argument("--num-layers", type=a.layers, help="the first N layers only (as cpkv run)")
    p.add_argument("--experts", type=a.experts, help="routed experts per MoE layer: fewer than the model's keeps every dimension and the depth and routes over that many (one rank's share at cp N on one GPU, e.g. --model glm5 --experts 32); presets only")
    p.add_argument("--chunk-size", type=a.tokens, default=SIZES.chunk_size,
                   help=f"new tokens per batch (default {SIZES.chunk_size})")
    p.add_argument("--page-size", type=a.page_size, default=DEFAULT_PAGE_SIZE,
                   help=f"tokens per KV page (default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--max-requests", type=a.batch_requests, default=SIZES.max_requests,
                   help=f"requests per batch (default {SIZES.max_requests})")
    p.add_argument("--pages-per-rank", type=a.bounded_int(2, a.MAX_PAGES),
                   help="plan this pool (page 0 reserved) instead of the largest that fits")
    p.add_argument("--graph-tokens", type=a.bounded_int(0, 1 << 16), default=None, metavar="N",
                   help=f"the engine's --graph-tokens: its CUDA graphs' buffers and pool (default {GRAPH_TOKENS} at fp8 "
                        "precision, 0 at exact, as cpkv run on CUDA; 0: none)")
    p.add_argument("--verify", action=argparse.BooleanOptionalAction, default=False,
                   help="plan cpkv run's verification too: the decisions each batch records (cpkv run verifies unless "
                        "--no-verify; default here: not)")
    p.add_argument("--json", action="store_true", help="print JSON")


def run(args: argparse.Namespace) -> int:
    from cpkv.cli.args import as_flags, flags_of
    from cpkv.config import CPConfig
    from cpkv.engine.config import default_graph_tokens
    from cpkv.memplan import GB, Setup, default_weights, plan_memory
    from cpkv.model.config import COMPUTE_DTYPES, load_model_config, with_precision

    budget = int(args.gpu_memory * GB) if args.gpu_memory else gpu_memory() or int(DEFAULT_GPU_GB * GB)
    with as_flags(flags_of(("cp", "page_size", "chunk_size", "pages_per_rank", "num_layers", "experts", "weights"))):
        CPConfig(args.cp, args.page_size)  # validates
        model = with_precision(load_model_config(args.model, args.num_layers, args.experts), args.precision, COMPUTE_DTYPES["cuda"])
        model.token_format  # noqa: B018 -- fp8 rows need kv_lora_rank in whole 128-value groups
        setup = Setup(model, args.cp, budget, weights=args.weights or default_weights(args.model),
                      page_size=args.page_size, chunk_size=args.chunk_size, max_requests=args.max_requests,
                      pages_per_rank=args.pages_per_rank,
                      graph_tokens=default_graph_tokens("cuda", args.graph_tokens, args.precision),
                      record=args.verify)
    plan = plan_memory(setup)
    if args.json:
        from cpkv.cli.fmt import emit_json
        emit_json({**plan.to_json(args.model), "routed_experts": plan.setup.model.n_routed_experts,
                   "experts_option": args.experts})
    else:
        show(plan, args)
    return 0 if plan.fits else 1


def show(plan, args: argparse.Namespace) -> None:
    from cpkv.cli.fmt import table
    from cpkv.memplan import GB, ITEMS, largest_text

    s, m = plan.setup, plan.setup.model
    print(f"{m.name}: {_count(plan.params)} parameters, {m.num_layers} layers "
          f"({m.mlp_layer_types.count('sparse')} MoE), weights {plan.weights_dtype()}, KV {m.kv_dtype}; cp {s.cp}, "
          f"{s.budget / GB:.1f} GB per GPU, chunk {s.chunk_size}, page {s.page_size}"
          + (f"; routing over {m.n_routed_experts} experts per MoE layer (--experts)" if args.experts else "") + "\n")
    rows = [(label, f"{plan.items[key] / GB:.2f}", _what(plan, key)) for key, label, _ in ITEMS]
    rows.append(("total", f"{plan.total / GB:.2f}", f"of {s.budget / GB:.2f} GB"))
    table(("per rank", "GB", ""), rows)
    tokens = plan.kv_tokens
    if plan.fits or s.pages_per_rank is not None:
        print(f"\nKV tokens per rank: {tokens:,} ({plan.pages} pages of {s.page_size}, page 0 reserved)")
        print(f"node of {s.cp}: shared KV (cpkv) caches {s.cp * tokens:,} tokens; replicated KV caches {tokens:,}")
    else:
        print(f"\nKV tokens per rank: none fit (the KV pool above is the smallest useful one: {tokens:,} tokens, "
              "the busiest rank's share of one chunk)")
    if plan.fits:
        from cpkv.memplan import reference_bytes

        alone = reference_bytes(m, s.weights, s.compute, s.device) > s.budget  # --verify's single-rank model
        print(f"fits: cpkv run --model {args.model}{f' --num-layers {m.num_layers}' if args.num_layers else ''}"
              f"{f' --experts {args.experts}' if args.experts else ''} --cp {s.cp} --device cuda --weights {s.weights} --chunk-size "
              f"{s.chunk_size} --page-size {s.page_size} --pages-per-rank {plan.pages}"
              f"{f' --graph-tokens {s.graph_tokens}' if s.graph_tokens else ''}"
              f"{' --no-verify' if alone else ''} ...")
        return
    print(f"does not fit: {plan.total / GB:.1f} GB per rank needed, {s.budget / GB:.1f} GB available; "
          f"{largest_text(plan)}")


def _count(n: int) -> str:
    return f"{n / 1e9:.1f} B" if n >= 1e9 else f"{n / 1e6:.1f} M"


def _what(plan, key: str) -> str:
    """The table's note on one item."""
    s, m = plan.setup, plan.setup.model
    if key == "weights_bytes":
        return "attention, indexer, dense MLPs, shared experts, router, embeddings, head; kv_b_proj and W_UK/W_UV"
    if key == "expert_bytes":
        return f"{s.experts_per_rank} of {m.n_routed_experts} routed experts x {m.mlp_layer_types.count('sparse')} layers"
    if key == "kv_bytes":
        return f"{plan.pages} pages x {s.page_size} tokens x {m.kv_bytes_per_token():,} B"
    if key == "compose_bytes":
        return "dense buffers for a batch over every cached token, both kinds, two halves"
    if key == "logits_bytes":
        return "one chunk, CPKV_MQA_LOGITS_CHUNK_MAX_GB at most"
    if key == "activation_bytes":
        return f"MoE dispatch of chunk x {m.num_experts_per_tok} rows" if m.n_routed_experts else ""
    if key == "decision_bytes":
        return "expert ids and indexer selections per batch (--verify)" if s.record else ""
    if key == "workspace_bytes":
        return "CUDA context, libraries, NCCL; allocator slack"
    return ""


def gpu_memory() -> int | None:
    """Bytes of the first visible GPU, or None without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def host_available() -> int:
    """The host's available memory in bytes (``cli.hostmem``; 0 when the machine does not say)."""
    from cpkv.cli.hostmem import host_memory

    return host_memory().available or 0


def check_run(cfg, model, torchrun: bool = False, verify: bool = False) -> None:
    """``cpkv run``'s pre-check: ConfigError (one line, the option to change) unless ``cfg`` (EngineConfig) with
    ``model`` (its ``model_config()``) fits each rank's share of its GPU, or on CPU of the host's memory, and
    (``verify``) the single-rank reference's whole model fits one GPU (the host)."""
    from cpkv.memplan import GB, plan_memory, reference_bytes, refusal

    got = rank_budget(cfg, torchrun)
    if got is None:
        return  # no GPU (the launcher names it), or the machine does not say what it has
    total, sharing, where = got
    setup = run_setup(cfg, model, total // sharing)
    why = refusal(plan_memory(setup), where)
    if why is not None:
        raise ConfigError(f"{why} (cpkv plan shows every item)")
    need = reference_bytes(model, setup.weights, setup.compute, cfg.device)
    if verify and need > total:
        raise ConfigError(f"--verify reruns every request on one {'GPU' if cfg.device == 'cuda' else 'host'}, whose "
                          f"whole model needs {need / GB:.1f} GB, more than its {total / GB:.1f} GB: pass --no-verify "
                          "(or --num-layers)")


def rank_budget(cfg, torchrun: bool = False) -> tuple[int, int, str] | None:
    """(the device's bytes, ranks sharing it, what a rank's budget is in words) for ``cfg`` (EngineConfig): its
    GPU, or on CPU the host's available memory; None when there is nothing to measure."""
    if cfg.device == "cuda":
        import torch

        total = gpu_memory()
        if total is None:
            return None
        sharing = 1 if torchrun or torch.cuda.device_count() >= cfg.cp else cfg.cp
        return total, sharing, "one GPU" if sharing == 1 else f"a rank's share of the one GPU {sharing} ranks share"
    total = host_available()
    if not total:
        return None
    return total, cfg.cp, f"a rank's share of the host's available memory ({cfg.cp} ranks)"


def plan_vs_peak(cfg, model, measured: list) -> list[dict] | None:
    """Per rank, the memory plan of ``cfg`` (EngineConfig) with ``model`` (its ``model_config()``) beside what the
    run measured (``gpu_memory_per_rank``: setup, peak allocated and peak reserved bytes): the ratios of the peaks
    to the plan's total, whether the plan bounds the reserved peak and lies within 10 % above it. The plan's
    ``context_bytes`` (CUDA context and libraries) is memory torch's allocator never sees. None off CUDA."""
    from cpkv.memplan import WORKSPACE, plan_memory

    if cfg.device != "cuda" or not measured or not any(measured):
        return None
    plan = plan_memory(run_setup(cfg, model, 0))  # the run's pool: its items do not depend on the budget
    total, out = plan.total, []
    for m in measured:
        if not m:
            out.append(None)
            continue
        alloc, reserved = m["peak_bytes"], m["peak_reserved_bytes"]
        out.append({"plan_total_bytes": total, "context_bytes": WORKSPACE["cuda"][0],
                    "peak_allocated_bytes": alloc, "peak_reserved_bytes": reserved,
                    "allocated_ratio": round(alloc / total, 4), "reserved_ratio": round(reserved / total, 4),
                    "bounds": total >= reserved, "within_10pct": total >= reserved and total <= 1.1 * reserved})
    return out


def run_setup(cfg, model, budget: int, pages_per_rank: int | None = -1):
    """The memory plan's ``Setup`` of ``cfg`` at ``budget`` bytes per rank (``pages_per_rank`` None: the largest
    pool that fits; -1: ``cfg``'s)."""
    from cpkv.memplan import Setup
    from cpkv.model.config import COMPUTE_DTYPES

    pages = cfg.pages_per_rank if pages_per_rank == -1 else pages_per_rank
    return Setup(model, cfg.cp, budget, weights=cfg.weights_dtype, compute=COMPUTE_DTYPES[cfg.device],
                 device=cfg.device, page_size=cfg.page_size, chunk_size=cfg.chunk_size,
                 max_requests=cfg.caps().max_requests, pages_per_rank=pages, host_pages=cfg.host_pages,
                 graph_tokens=cfg.graph_tokens, record=cfg.record)

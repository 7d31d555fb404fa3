"""``cpkv bench indexer --decode``: the decode step's indexer logits over paged index rows (GLM-5 shapes: H = 32,
D = 128, 132-byte rows, P = 64, two pools) on CUDA.

Per case (B generations x ctx keys each, L = ctx, pages spread over the pools as a decode table spreads them):
device time of ``paged_logits_triton`` (CUDA events behind a spin kernel: no launch cost), the bytes it reads
(B * ctx * 132 + q + weights) and moves (plus the [B, L] float32 logits it writes), and its rate against a
``copy_`` of the bytes read measured in the same run (read + written, as ``bench.timing.copy_gbs`` counts). Every
named kernel config is timed; its output is checked against the default config's (same -inf positions, within
2e-3 of each row's largest |logit|) and the default's against the reference on the smallest case.

Then the decode step's top-k (k = 2048) of the default config's logits over [0, ctx), device time of both paths
in the same run: the stream kernel (one program per row, ``TopkConfig(splits=1)``) and the default (the split path
where ``kernels.topk.triton.splits_for`` takes it), their ratio, beside them each split count of SPLIT_SWEEP, the
merge launch at MERGE_WARPS_SWEEP warps and as a programmatic dependent launch (pdl); every result is checked
against ``topk_ref`` index for index. The floor: the logits read and the indices written at the copy rate above.
"""
from __future__ import annotations

HEADS, DIM, PAGE, CP = 32, 128, 64, 2
ROW = DIM + 4
DECODE_BATCHES = (1, 8, 32)
DECODE_KEYS = (1024, 32768, 131072)
TOPK = 2048
SPLIT_SWEEP = (4, 8, 16, 32, 64)
MERGE_WARPS_SWEEP = (4, 8)


def decode_configs() -> dict:
    """Named PagedLogitsConfig variants (the first is the default)."""
    from cpkv.kernels.mqa_logits.config import PagedLogitsConfig as C
    from cpkv.kernels.mqa_logits.paged import DEFAULT_CONFIG

    named = {"s64_x1_w4": C(64, 1, 4, 2), "s64_x8_w4_st3": C(64, 8, 4, 3), "s128_x2_w8": C(128, 2, 8, 2),
             "s128_x4_w4": C(128, 4, 4, 2), "s32_x4_w4": C(32, 4, 4, 2), "s128_x8_w8_st3": C(128, 8, 8, 3)}
    return {"default": DEFAULT_CONFIG, **{k: v for k, v in named.items() if v != DEFAULT_CONFIG}}


def make_case(B: int, ctx: int, seed: int = 0, device: str = "cuda") -> dict:
    """Pools, table and query of B generations of ctx keys: generation b's page j on rank (b + j) % CP."""
    import torch

    from cpkv.indexer import quantize_index_keys, quantize_queries

    gen = torch.Generator(device=device).manual_seed(seed)
    pages = -(-ctx // PAGE)
    owner = (torch.arange(B, device=device)[:, None] + torch.arange(pages, device=device)[None, :]) % CP
    page = torch.empty_like(owner)
    pools = []
    for r in range(CP):
        mine = owner == r
        n = int(mine.sum())
        page[mine] = torch.randperm(n, device=device, generator=gen)
        pools.append(torch.cat([quantize_index_keys(torch.randn(min(1 << 20, n * PAGE - i), DIM, device=device,
                                                                generator=gen))
                                for i in range(0, n * PAGE, 1 << 20)]))
    q, w = quantize_queries(torch.randn(B, HEADS, DIM, device=device, generator=gen),
                            torch.randn(B, HEADS, device=device, generator=gen) * HEADS ** -0.5)
    return {"q": q, "weights": w, "pools": pools, "owner_tab": owner, "page_tab": page,
            "bases": torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64, device=device),
            "slot": torch.arange(B, device=device), "ctx": torch.full((B,), ctx, device=device),
            "out": torch.empty(B, ctx, device=device)}


def _launch(c: dict, cfg):
    from cpkv.kernels.mqa_logits.paged import paged_logits_triton

    return lambda: paged_logits_triton(c["q"], c["weights"], c["bases"], c["owner_tab"], c["page_tab"], c["slot"],
                                       c["ctx"], PAGE, c["out"], config=cfg)


def rows_close(got, want, eps: float = 2e-3) -> bool:
    """Logits [B, L] alike: infinite at the same places, elsewhere within ``eps`` of each row's largest |want|."""
    import torch

    if not torch.equal(torch.isinf(got), torch.isinf(want)):
        return False
    fin = torch.isfinite(want)
    scale = want.masked_fill(~fin, 0).abs().amax(1, keepdim=True).clamp(min=1e-30)
    return bool((((got.double() - want.double()).abs() / scale).masked_fill(~fin, 0) <= eps).all())


def bench_case(B: int, ctx: int, check_ref: bool) -> dict:
    import torch

    from cpkv.bench.timing import event_median_s
    from cpkv.kernels.mqa_logits.ref import paged_mqa_logits_ref

    c = make_case(B, ctx)
    read = B * ctx * ROW + c["q"].numel() + c["weights"].numel() * 4
    moved = read + c["out"].numel() * 4
    src = torch.empty(read, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    copy_s = event_median_s(lambda: dst.copy_(src), device_only=True)
    copy_gbs = 2 * read / copy_s / 1e9
    del src, dst
    rows = []
    want = None
    for name, cfg in decode_configs().items():
        try:
            run = _launch(c, cfg)
            s = event_median_s(run, device_only=True)
            c["out"].fill_(7.0)
            run()
            if want is None:
                want = c["out"].clone()
            row = {"config": name, "us": s * 1e6, "read_gbs": read / s / 1e9, "moved_gbs": moved / s / 1e9,
                   "ratio_to_copy": moved / s / 1e9 / copy_gbs, "equal_to_default": rows_close(c["out"], want)}
        except Exception as exc:  # a config that does not compile is reported, not fatal
            row = {"config": name, "error": str(exc)[:300]}
        rows.append(row)
    res = {"batch": B, "keys": ctx, "bytes_read": read, "bytes_moved": moved, "copy_us": copy_s * 1e6,
           "copy_gbs": copy_gbs, "configs": rows}
    if want is not None:
        res["topk"] = bench_topk(want, c["ctx"], copy_gbs)
    if check_ref:
        ref = paged_mqa_logits_ref(c["q"], c["weights"], c["pools"], c["owner_tab"], c["page_tab"], c["slot"],
                                   c["ctx"], PAGE, ctx, dtype=torch.float64)
        res["default_matches_reference"] = rows_close(want, ref)
    del c
    torch.cuda.empty_cache()
    return res


def bench_topk(logits, ctx, copy_gbs: float) -> dict:
    """Top-k of logits float32 [B, L] over [0, ctx) (module docstring): the stream kernel, the default and the
    forced split counts, each timed (device time) and checked against topk_ref."""
    import torch

    from cpkv.bench.timing import event_median_s
    from cpkv.indexer.topk import topk_into
    from cpkv.kernels.topk.ref import topk_ref
    from cpkv.kernels.topk.triton import DEFAULT_CONFIG, TopkConfig, candidate_slots, splits_for

    B, L = logits.shape
    lo, hi = torch.zeros(B, dtype=torch.int32, device=logits.device), ctx.to(torch.int32)
    out = torch.empty(B, TOPK, dtype=torch.int32, device=logits.device)
    want = topk_ref(logits, lo, hi, TOPK)

    def timed(cfg) -> dict:
        run = lambda: topk_into(logits, lo, hi, TOPK, out, config=cfg)  # noqa: E731
        s = event_median_s(run, device_only=True)
        out.fill_(-2)
        run()
        return {"us": s * 1e6, "equal_to_reference": bool(torch.equal(out, want))}

    floor_us = (logits.numel() + out.numel()) * 4 / (copy_gbs * 1e9) * 1e6
    stream, split = timed(TopkConfig(splits=1)), timed(None)
    sweep = {}
    if L > candidate_slots(TOPK):  # else every row is within the slots: the stream kernel's one pass is all
        sweep.update({f"s{s}": timed(TopkConfig(splits=s)) for s in SPLIT_SWEEP})
        sweep.update({f"merge_w{w}": timed(TopkConfig(merge_warps=w)) for w in MERGE_WARPS_SWEEP})
        sweep["pdl"] = timed(TopkConfig(pdl=True))
    return {"k": TOPK, "splits": splits_for(B, L, TOPK, DEFAULT_CONFIG, logits.device), "floor_us": floor_us,
            "stream": stream, "split": split, "stream_over_split": stream["us"] / split["us"], "sweep": sweep}


def bench_decode(batches=DECODE_BATCHES, keys=DECODE_KEYS) -> dict:
    import torch

    cases = [bench_case(B, n, check_ref=(B, n) == (min(batches), min(keys))) for n in keys for B in batches]
    return {"device": torch.cuda.get_device_name(), "heads": HEADS, "dim": DIM, "page_size": PAGE, "pools": CP,
            "cases": cases}


def print_decode(r: dict, table) -> None:
    print(f"{r['device']}: paged decode logits, H={r['heads']} D={r['dim']} P={r['page_size']} over {r['pools']} "
          f"pools; device time; GB/s of bytes moved (rows read + logits written) against a copy_ of the bytes read")
    rows = []
    for c in r["cases"]:
        ok = [x for x in c["configs"] if "us" in x]
        best = min(ok, key=lambda x: x["us"]) if ok else {"config": "-", "us": float("nan"), "ratio_to_copy": 0}
        d = c["configs"][0]
        rows.append((c["batch"], c["keys"], c["bytes_read"], d.get("us", "-"), d.get("ratio_to_copy", d.get("error")),
                     best["config"], best["us"], best["ratio_to_copy"], c["copy_gbs"],
                     all(x.get("equal_to_default", False) for x in ok)))
    table(["B", "keys", "bytes read", "default µs", "/copy", "best config", "best µs", "best /copy", "copy GB/s",
           "configs agree"], rows)
    print_topk(r, table)
    for c in r["cases"]:
        if "default_matches_reference" in c:
            print(f"B={c['batch']} keys={c['keys']}: default config equals the reference: "
                  f"{c['default_matches_reference']}")


def print_topk(r: dict, table) -> None:
    print(f"decode top-k (k = {TOPK}) of the default config's logits over [0, ctx): the stream kernel (one program a "
          f"row) against the default (split from the shapes); device time; floor: logits read + indices written "
          f"at the copy rate")
    rows = []
    for c in (c for c in r["cases"] if "topk" in c):
        t = c["topk"]
        best = min(t["sweep"].items(), key=lambda kv: kv[1]["us"], default=(None, {"us": float("nan")}))
        exact = all(x["equal_to_reference"] for x in (t["stream"], t["split"], *t["sweep"].values()))
        rows.append((c["batch"], c["keys"], t["stream"]["us"], t["splits"], t["split"]["us"], t["stream_over_split"],
                     t["split"]["us"] / t["floor_us"], best[0] or "-", best[1]["us"], exact))
    table(["B", "keys", "stream µs", "splits", "split µs", "stream/split", "split/floor", "best variant", "its µs",
           "all exact"], rows)

"""Benchmark (GPU): the indexer's index-row kernel and the MoE router's score kernel at GLM-5's cold 32K prefill
shapes, each checked against its reference first. Run from the repository root:

    PYTHONPATH=src python3 benchmarks/elem_kernels.py [--tokens 32768] [--rope interleaved|halves] [--json]

index rows (``cpkv.kernels.index_rows.triton``): keys [T, 128] bf16 with LayerNorm -> index rows
[T, 132]; queries [T x 32 heads, 128] bf16 with folded weights -> fp8 [T, 32, 128] + float32 [T, 32]; RoPE on
the first 64 dims. Checks: scales / folded weights within 2e-5 relative of the float32 reference, fp8 values within
one e4m3 step (at most 2 % differing). Each time next to a ``copy_`` of the same bytes (read + written) and the
ratio to it. router (``cpkv.kernels.router.triton``): scores = sigmoid(x [T, 6144] bf16 @ gate [256,
6144]^T) against the present ``F.linear(x.float(), gate.float()).sigmoid()``, bf16 and float32 gates; scores
within 2^-18 sum|x g| / 4 + 2^-22 of a float64 reference; the experts GLM-5's and DeepSeek-V3.2's routing choose
from them equal to the float32 path's except at near ties. The variants and configs these timings once chose
between were deleted (BENCHMARKS.md, session 9). Exit 0 when every check holds.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from cpkv.bench.timing import do_bench_ms

HEADS, DIM, ROPE, HIDDEN, EXPERTS = 32, 128, 64, 6144, 256
LOGIT_TOL = 2.0 ** -18
DEV = "cuda"  # --device cpu: a smoke run under Triton's interpreter (tests), timings of single calls


def _time_ms(fn) -> float:
    if DEV == "cuda":
        return do_bench_ms(fn)
    import time

    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float(((got.float() - want.float()).abs() / want.float().abs().clamp_min(1e-30)).max())


def _near_fp8(got: torch.Tensor, want: torch.Tensor) -> tuple[bool, float]:
    g, w = got.float(), want.float()
    frac = float((g != w).float().mean())
    return bool(((g - w).abs() <= w.abs() * 2.0 ** -3 + 2.0 ** -9).all()) and frac <= 0.02, frac


def _copy_ms(nbytes: int) -> float:
    """A copy_ reading and writing nbytes / 2 each."""
    src = torch.empty(nbytes // 2, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return _time_ms(lambda: dst.copy_(src))


def index_rows(t: int, interleaved: bool, log) -> dict:
    from cpkv.indexer.quant import FP8, dequantize_index_rows
    from cpkv.kernels.index_rows import triton as kern
    from cpkv.kernels.index_rows.ref import index_keys_ref, index_queries_ref
    from cpkv.model.ops import Rotary

    gen = torch.Generator(device=DEV).manual_seed(7)
    rot = Rotary.build(torch.arange(t, device=DEV), ROPE, 1e6)
    k = (torch.randn(t, DIM, generator=gen, device=DEV) * 2).bfloat16()
    lw = (torch.randn(DIM, generator=gen, device=DEV) * 0.2 + 1).bfloat16()
    lb = (torch.randn(DIM, generator=gen, device=DEV) * 0.1).bfloat16()
    q = (torch.randn(t, HEADS, DIM, generator=gen, device=DEV) * 2).bfloat16()
    wts = torch.rand(t, HEADS, generator=gen, device=DEV) + 0.1
    args = (rot.cos, rot.sin, ROPE, interleaved)
    want_k, want_ks = dequantize_index_rows(index_keys_ref(k, lw, lb, *args))
    want_q, want_w = index_queries_ref(q, wts, *args)
    rows = torch.empty(t, DIM + 4, dtype=torch.uint8, device=DEV)
    k8, ks = dequantize_index_rows(rows)
    q8 = torch.empty(t, HEADS, DIM, dtype=FP8, device=DEV)
    folded = torch.empty(t, HEADS, device=DEV)
    qv, q8v, fv, wv = q.view(-1, DIM), q8.view(-1, DIM), folded.view(-1), wts.view(-1)
    key_bytes = t * DIM * 2 + t * (DIM + 4) + t * ROPE * 4  # x, rows, cos + sin
    query_bytes = t * HEADS * (DIM * 2 + DIM + 4 + 4) + t * ROPE * 4  # x, fp8, weights in, folded out, cos + sin
    copy_k, copy_q = _copy_ms(key_bytes), _copy_ms(query_bytes)
    log(f"copy_ of the same bytes: keys {copy_k:.4f} ms, queries {copy_q:.4f} ms")

    def keys():
        kern.index_rows(k, 1, rot.cos, rot.sin, ROPE, interleaved, k8, ks, norm=(lw, lb, 1e-6))

    def queries():
        kern.index_rows(qv, HEADS, rot.cos, rot.sin, ROPE, interleaved, q8v, fv, weights=wv)
    rows.zero_(), q8.zero_(), folded.zero_()
    keys(), queries()
    kn, kfrac = _near_fp8(k8, want_k)
    qn, qfrac = _near_fp8(q8, want_q)
    rec = {"key_scale_rel": _rel(ks, want_ks), "query_weight_rel": _rel(folded, want_w), "key_fp8_differ": kfrac,
           "query_fp8_differ": qfrac}
    rec["ok"] = rec["key_scale_rel"] <= 2e-5 and rec["query_weight_rel"] <= 2e-5 and kn and qn
    rec["keys_ms"], rec["queries_ms"] = _time_ms(keys), _time_ms(queries)
    rec["keys_vs_copy"], rec["queries_vs_copy"] = rec["keys_ms"] / copy_k, rec["queries_ms"] / copy_q
    rec["queries_GBps"] = query_bytes / rec["queries_ms"] / 1e6
    log(f"index rows {'ok ' if rec['ok'] else 'BAD'} keys {rec['keys_ms']:.4f} ms ({rec['keys_vs_copy']:.2f}x copy)"
        f"  queries {rec['queries_ms']:.4f} ms ({rec['queries_vs_copy']:.2f}x copy, {rec['queries_GBps']:.0f} GB/s)"
        f"  scale rel {max(rec['key_scale_rel'], rec['query_weight_rel']):.1e}  fp8 differ {max(kfrac, qfrac):.2e}")
    return rec


def router(t: int, log) -> list[dict]:
    import torch.nn.functional as F

    from cpkv.config import PRESETS
    from cpkv.kernels.router import triton as kern
    from cpkv.kernels.router.ref import route_differences
    from cpkv.model import moe

    gen = torch.Generator(device=DEV).manual_seed(11)
    x = torch.randn(t, HIDDEN, generator=gen, device=DEV).bfloat16()
    gate16 = (torch.randn(EXPERTS, HIDDEN, generator=gen, device=DEV) / HIDDEN ** 0.5).bfloat16()
    bias = torch.randn(EXPERTS, generator=gen, device=DEV) * 0.01
    out = []
    base = _time_ms(lambda: F.linear(x.float(), gate16.float()).sigmoid())
    log(f"router: F.linear(x.float(), gate.float()).sigmoid() {base:.4f} ms")
    scores = torch.empty(t, EXPERTS, device=DEV)
    for gdtype in (torch.bfloat16, torch.float32):
        gate = gate16.to(gdtype) if gdtype == torch.bfloat16 else (gate16.float() * (1 + 1e-3 * torch.randn(
            EXPERTS, HIDDEN, generator=gen, device=DEV)))
        want64 = x.double() @ gate.double().t()
        tol = (x.double().abs() @ gate.double().abs().t()) * (LOGIT_TOL / 4) + 2.0 ** -22
        want = want64.sigmoid()
        ref32_ok = bool(((F.linear(x.float(), gate.float()).sigmoid().double() - want).abs() <= tol).all())
        kern.router_scores(x, gate, scores)
        ok = bool(((scores.double() - want).abs() <= tol).all())
        ms = _time_ms(lambda gate=gate: kern.router_scores(x, gate, scores))
        rec = {"gate": str(gdtype).removeprefix("torch."), "ok": ok, "ms": ms, "vs_fp32_linear": ms / base,
               "max_err_over_tol": float(((scores.double() - want).abs() / tol).max()),
               "fp32_reference_within_tol": ref32_ok}
        out.append(rec)
        log(f"router {rec['gate']:8s} {'ok ' if ok else 'BAD'} {ms:.4f} ms ({rec['vs_fp32_linear']:.3f}x"
            f" of F.linear fp32)  max err / tol {rec['max_err_over_tol']:.3f} (fp32 reference within: {ref32_ok})")
        for preset in ("glm5", "deepseek-v32"):
            cfg = PRESETS[preset]
            idx, _ = moe.route(x, gate, bias, cfg)
            idx_ref, _ = moe.route(x, gate, bias, cfg, fused=False)
            differ, unexplained = route_differences(idx, idx_ref, want + bias.double(), 2 * tol.max(dim=1).values,
                                                    cfg.n_group, cfg.topk_group)
            out.append({"gate": str(gdtype).removeprefix("torch."), "route": preset, "tokens_differing": differ,
                        "without_near_tie": len(unexplained), "ok": not unexplained})
            log(f"route {preset} ({out[-1]['gate']} gate): {differ} of {t} tokens choose other experts than the "
                f"float32 path, {len(unexplained)} of them without a near tie")
    return out


def main(argv: list[str] | None = None) -> int:
    global DEV, HIDDEN
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--rope", choices=("interleaved", "halves"), default="interleaved")
    p.add_argument("--json", action="store_true")
    p.add_argument("--device", default="cuda", help=argparse.SUPPRESS)
    p.add_argument("--hidden", type=int, default=HIDDEN, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    DEV, HIDDEN = a.device, a.hidden
    if DEV == "cuda" and not torch.cuda.is_available():
        print("elem_kernels.py: error: needs a CUDA device", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        print(msg, file=sys.stderr if a.json else sys.stdout, flush=True)
    rows = index_rows(a.tokens, a.rope == "interleaved", log)
    route_recs = router(a.tokens, log)
    ok = rows["ok"] and all(r["ok"] for r in route_recs)
    if a.json:
        print(json.dumps({"tokens": a.tokens, "rope": a.rope, "index_rows": rows, "router": route_recs, "ok": ok},
                         indent=1))
    else:
        print(f"all checks {'hold' if ok else 'DO NOT hold'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

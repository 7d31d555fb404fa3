"""Output comparisons shared by the attention benchmarks (prefill and decode, cpkv against a peer kernel)."""
from __future__ import annotations

from typing import Any


def compare_outputs(theirs: tuple, ours: tuple) -> dict[str, Any]:
    """FlashMLA's (out, max_logits, lse) against cpkv's (out, lse): cosine difference as FlashMLA's tests
    define it (1 - 2 x.y / (x.x + y.y)), largest |difference| over largest |out|, lse (natural log) difference."""
    out_p, _, lse_p = theirs
    out_o, lse_o = ours
    x, y = out_p.double(), out_o.double()
    cos = float(1 - 2 * (x * y).sum() / (x * x + y * y).sum().clamp(min=1e-300))
    rel_max = float((x - y).abs().max() / x.abs().max().clamp(min=1e-300))
    lp, lo = lse_p.float().reshape(lse_o.shape), lse_o.float()
    same_inf = bool((lp.isinf() == lo.isinf()).all())
    fin = lp.isfinite() & lo.isfinite()
    lse_diff = float((lp[fin] - lo[fin]).abs().max()) if bool(fin.any()) else 0.0
    return {"out_cos_diff": cos, "out_max_diff_rel": rel_max, "lse_max_diff": lse_diff, "lse_inf_equal": same_inf}

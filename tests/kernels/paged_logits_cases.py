"""Cases of the paged indexer logits kernel (cpkv.kernels.mqa_logits.paged), run by Triton's interpreter on CPU
tensors (not collected by pytest: ``test_paged_logits_kernel.py`` runs each case in a subprocess with
TRITON_INTERPRET=1), and the inputs / comparison the GPU test shares.

    python tests/kernels/paged_logits_cases.py <case>      exit 0 when every check holds

Tolerance. Against the float64 reference (dots exact for fp8 inputs), with float32 arithmetic in any order:
each dot of D products is off by at most gamma(D - 1) * sum_d |q k|, relu is 1-Lipschitz, the weight product and
the scale add one rounding each, the head sum of H terms gamma(H - 1): so |got - ref| <= gamma(D + H + 2) * mag,
gamma(n) = n u / (1 - n u), u = 2^-24, mag[b, s] = scale(s) * sum_h |w[b, h]| sum_d |q[b, h, d] k(s)[d]| (the
reference over |q|, |k|, |w|). The interpreter computes in float32, so it is held to that bound. On the GPU the
fp8 tensor cores accumulate with fewer bits than float32, so the GPU test uses the bound of the existing logits
tests (tests/indexer/test_indexer_gpu.py): within 2e-3 of each row's largest |logit|. -inf positions must match
exactly in both.
"""
from __future__ import annotations

import sys

import torch

SKIP = 77
U = 2.0 ** -24


def gamma(n: int) -> float:
    return n * U / (1 - n * U)


def make_inputs(B, H, D, P, ctx, L, *, cp=2, pages=None, slots=None, seed=0, device="cpu"):
    """Random pools (cp of them, quantized index rows), a page table whose unused entries are garbage (any read of
    them would be far out of bounds), generation b in slot ``slots[b]`` with context ``ctx[b]``."""
    from cpkv.indexer import quantize_index_keys, quantize_queries

    g = torch.Generator().manual_seed(seed)
    max_pages = -(-L // P)
    slots = slots or [(3 * b + 1) % (B + 2) for b in range(B)]
    n_slots = max(slots) + 1
    pages = pages or max(4, -(-sum(ctx) // P) + 2)
    pools = [quantize_index_keys(torch.randn(pages * P, D, generator=g) * (1 + r)).to(device) for r in range(cp)]
    owner = torch.full((n_slots, max_pages), 1 << 20, dtype=torch.int64)
    page = torch.full((n_slots, max_pages), 1 << 40, dtype=torch.int64)
    for b, (sl, n) in enumerate(zip(slots, ctx)):
        used = -(-n // P)
        owner[sl, :used] = torch.randint(0, cp, (used,), generator=g)
        page[sl, :used] = torch.randperm(pages, generator=g)[:used]
    q, w = quantize_queries(torch.randn(B, H, D, generator=g), torch.randn(B, H, generator=g))
    t = dict(q=q, weights=w, owner_tab=owner, page_tab=page, slot=torch.tensor(slots), ctx=torch.tensor(ctx))
    t = {k: v.to(device) for k, v in t.items()}
    bases = torch.tensor([p.data_ptr() for p in pools], dtype=torch.int64, device=device)
    return t, pools, bases


def reference(t, pools, P, L, *, absolute=False):
    """float64 reference logits [B, L]; with ``absolute`` the magnitudes of the tolerance (|q|, |k|, |w|)."""
    from cpkv.kernels.mqa_logits.ref import paged_mqa_logits_ref

    q, w = t["q"], t["weights"]
    if absolute:
        D = q.shape[2]
        q = q.view(torch.uint8).bitwise_and(0x7F).view(torch.float8_e4m3fn)
        w = w.abs()
        pools = [p.clone() for p in pools]
        for p in pools:
            p[:, :D] &= 0x7F  # fp8 sign bits off (scales are positive)
    return paged_mqa_logits_ref(q, w, pools, t["owner_tab"], t["page_tab"], t["slot"], t["ctx"], P, L,
                                dtype=torch.float64)


def mismatch(got: torch.Tensor, ref: torch.Tensor, bound: torch.Tensor | None = None,
             row_eps: float | None = None) -> str | None:
    """None when ``got`` matches ``ref`` (float64): -inf exactly where ref's, the finite values within ``bound``
    (elementwise) or ``row_eps`` times each row's largest |ref|; else where the largest error is."""
    if not torch.equal(torch.isinf(got), torch.isinf(ref)):
        at = (torch.isinf(got) != torch.isinf(ref)).nonzero()[:4].tolist()
        return f"-inf positions differ at {at}"
    fin = torch.isfinite(ref)
    if bound is None:
        bound = (row_eps * ref.masked_fill(~fin, 0).abs().amax(1, keepdim=True)).expand_as(ref)
    excess = ((got.double() - ref).abs() - bound).masked_fill(~fin, float("-inf"))
    if fin.any() and float(excess.max()) > 0:
        b, s = divmod(int(excess.argmax()), ref.shape[1])
        return f"error {float((got[b, s] - ref[b, s]).abs()):.3g} > bound {float(bound[b, s]):.3g} at {(b, s)}"
    return None


def _run(t, bases, P, L, config=None, out=None):
    from cpkv.kernels.mqa_logits import paged

    out = torch.full((t["q"].shape[0], L), 7.0) if out is None else out
    return paged.paged_logits_triton(t["q"], t["weights"], bases, t["owner_tab"], t["page_tab"], t["slot"],
                                     t["ctx"], P, out, config=config)


def _configs():
    from cpkv.kernels.mqa_logits.config import PagedLogitsConfig as C
    from cpkv.kernels.mqa_logits.paged import DEFAULT_CONFIG, KEYS_CONFIG

    # each variant with tiles inside a page (16 < P = 32 / 64), a page per tile, tiles over several pages, spans
    # past L; the runs kernel also at 2 stages (its loop pipelined)
    return [DEFAULT_CONFIG, C(16, 1), C(16, 3), C(32, 2, num_stages=2), C(64, 2),
            KEYS_CONFIG, C(16, 1, variant="keys"), C(16, 3, variant="keys"), C(32, 2, variant="keys")]


SHAPES = [  # (B, H, D, P, ctx, L)
    (3, 4, 32, 16, [0, 5, 37], 64),
    (3, 4, 128, 16, [37, 0, 5], 64),
    (3, 4, 32, 64, [5, 37, 0], 50),   # L not a multiple of any tile; P larger than the tiles
    (2, 8, 64, 32, [64, 33], 64),     # contexts that fill / just pass a page
]

# the runs kernel's own corners (three pools): pages of 4 keys (32 runs in a 128-key tile), pages larger than the
# default tile, B and L not multiples of any tile, contexts ending inside a run, at a run's or a tile's edge
RUN_SHAPES = [  # (B, H, D, P, ctx, L, cp)
    (5, 4, 32, 4, [0, 1, 130, 300, 61], 300, 3),
    (5, 8, 64, 256, [300, 255, 256, 129, 0], 300, 3),
    (3, 32, 128, 64, [200, 64, 127], 200, 3),
]


def case_matches_reference() -> None:
    for B, H, D, P, ctx, L in SHAPES:
        t, pools, bases = make_inputs(B, H, D, P, ctx, L)
        ref = reference(t, pools, P, L)
        bound = gamma(D + H + 2) * reference(t, pools, P, L, absolute=True)
        if 0 in ctx:
            assert bool(torch.isinf(ref[ctx.index(0)]).all())  # the padded entry: all -inf
        for cfg in _configs():
            got = _run(t, bases, P, L, cfg)
            err = mismatch(got, ref, bound)
            assert err is None, f"{(B, H, D, P, ctx, L)} {cfg}: {err}"
    print("matches_reference: ok")


def case_planted_faults_fail() -> None:
    from cpkv.kernels.mqa_logits.paged import DEFAULT_CONFIG, KEYS_CONFIG

    B, H, D, P, ctx, L = SHAPES[0]
    t, pools, bases = make_inputs(B, H, D, P, ctx, L)
    ref = reference(t, pools, P, L)
    bound = gamma(D + H + 2) * reference(t, pools, P, L, absolute=True)
    sl = int(t["slot"][2])  # the generation with 37 keys: pages 0..2
    faults = {"page": ("page_tab", (sl, 1), lambda v: (v + 1) % 4),
              "owner": ("owner_tab", (sl, 2), lambda v: 1 - v)}
    for cfg in (DEFAULT_CONFIG, KEYS_CONFIG):
        for name, (key, at, change) in faults.items():
            bad = dict(t, **{key: t[key].clone()})
            bad[key][at] = change(bad[key][at])
            assert mismatch(_run(bad, bases, P, L, cfg), ref, bound) is not None, f"{cfg}: planted fault {name} passed"
        short = dict(t, ctx=t["ctx"] - (t["ctx"] > 0).long())  # one key fewer: a -inf too many
        assert "-inf" in mismatch(_run(short, bases, P, L, cfg), ref, bound)
        swapped = bases.flip(0)  # every owner wrong
        assert mismatch(_run(t, swapped, P, L, cfg), ref, bound) is not None
    print("planted_faults_fail: ok")


def case_runs_corners() -> None:
    from cpkv.kernels.mqa_logits import paged
    from cpkv.kernels.mqa_logits.config import PagedLogitsConfig as C

    for B, H, D, P, ctx, L, cp in RUN_SHAPES:
        t, pools, bases = make_inputs(B, H, D, P, ctx, L, cp=cp, seed=B + P)
        ref = reference(t, pools, P, L)
        bound = gamma(D + H + 2) * reference(t, pools, P, L, absolute=True)
        for cfg in (C(), C(16, 5), C(64, 2), C(256, 1, num_warps=8), C(32, 3, num_stages=2)):
            got = _run(t, bases, P, L, cfg)
            err = mismatch(got, ref, bound)
            assert err is None, f"{(B, H, D, P, ctx, L, cp)} {cfg}: {err}"
    paged.MAX_GRID_Y = 2  # the last shape's B = 3 in two launches of the generations' axis
    assert mismatch(_run(t, bases, P, L), ref, bound) is None, "generations split over launches"
    print("runs_corners: ok")


def case_same_launch_other_contexts() -> None:
    """One set of tensors, ctx / slot rewritten in place between launches (as a graph replay sees them): each run
    equals the reference of the values then in the tensors, and every column is written (out starts at 7)."""
    from cpkv.kernels.mqa_logits.paged import DEFAULT_CONFIG, KEYS_CONFIG

    B, H, D, P, ctx, L = SHAPES[0]
    t, pools, bases = make_inputs(B, H, D, P, [37, 37, 37], L)
    out = torch.empty(B, L)
    for cfg in (DEFAULT_CONFIG, KEYS_CONFIG):
        for new in ([0, 5, 37], [37, 0, 0], [1, 16, 17]):
            t["ctx"].copy_(torch.tensor(new))
            t["slot"].copy_(t["slot"].roll(1))
            got = _run(t, bases, P, L, cfg, out=out.fill_(7.0))
            assert not bool((got == 7.0).any()), "a column left unwritten"
            bound = gamma(D + H + 2) * reference(t, pools, P, L, absolute=True)
            err = mismatch(got, reference(t, pools, P, L), bound)
            assert err is None, f"{cfg} ctx {new}: {err}"
    print("same_launch_other_contexts: ok")


def main(name: str) -> int:
    from fused_cases import patch_interpreter_index

    try:
        import triton  # noqa: F401
    except ImportError:
        print("no Triton")
        return SKIP
    patch_interpreter_index()  # the tile loops' bounds come from ctx on the "device"
    globals()[f"case_{name}"]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

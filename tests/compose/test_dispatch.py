"""Expert-parallel dispatch / combine (``cpkv.compose.dispatch``) on real rank processes (gloo, /dev/shm peer
memory and the counting barrier; or, without peer memory, the all-reduce fallback), against
``torch.distributed.all_to_all_single`` with split sizes read back to the host (the reference path) and
against every expert run in one process. Batches with ranks that hold no tokens and experts no token
chose (whole ranks without rows) included."""
from __future__ import annotations

import pytest
import torch

from cpkv.compose.dispatch import ExpertExchange
from cpkv.compose.peer import PeerMemory
from cpkv.compose.runtime import ComposeRuntime
from cpkv.config import AdmissionCaps, preset
from cpkv.dist import launch
from cpkv.kvcache.pool import KVPool
from cpkv.model.experts import ExpertWeights, grouped_swiglu
from cpkv.model.moe import expert_block, experts_loop

D, INTER, E, T_CAP = 16, 8, 8, 32


def _weights(seed: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(E, 2 * INTER, D, generator=g) / D ** 0.5, torch.randn(E, D, INTER, generator=g) / INTER ** 0.5


def _batch(counts: list[int], k: int, route: str, seed: int):
    """The whole batch, the same on every rank: x [T, D], idx int64 [T, k] (distinct experts per token), w [T, k].
    ``route``: "random", or "low" (every token picks among experts 0..k-1: the other ranks' experts stay empty)."""
    g = torch.Generator().manual_seed(seed)
    t = sum(counts)
    x = torch.randn(t, D, generator=g)
    pool = E if route == "random" else k
    idx = torch.stack([torch.randperm(pool, generator=g)[:k] for _ in range(t)]) if t else torch.zeros(0, k)
    return x, idx.long().view(t, k), torch.rand(t, k, generator=g) + 0.5


def all_to_all_reference(ctx, x, idx, w, gate_up, down, local: range) -> torch.Tensor:
    """The same MoE output through ``all_to_all_single`` (split sizes read back to the host): pairs to the rank
    of their expert, each expert's SwiGLU weighted there, the outputs back, each token's k summed."""
    import torch.distributed as dist

    cp, (t, k) = ctx.world_size, idx.shape
    home, dev = x.device, ctx.collective_device  # gloo collectives take CPU tensors, NCCL CUDA ones
    x, idx, w, gate_up, down = (v.to(dev) for v in (x, idx, w, gate_up, down))
    flat = idx.reshape(-1)
    owner = flat // len(local)
    order = torch.argsort(owner, stable=True)
    send = torch.bincount(owner, minlength=cp)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=ctx.group)
    send_n, recv_n = send.tolist(), recv.tolist()

    def a2a(v: torch.Tensor, out_rows: list[int], in_rows: list[int]) -> torch.Tensor:
        out = torch.empty(sum(out_rows), *v.shape[1:], dtype=v.dtype, device=v.device)
        dist.all_to_all_single(out, v.contiguous(), out_rows, in_rows, group=ctx.group)
        return out

    rx = a2a(x[order // k], recv_n, send_n)
    re = a2a(flat[order], recv_n, send_n) - local.start
    rw = a2a(w.reshape(-1)[order], recv_n, send_n)
    y = experts_loop(rx, re[:, None], rw[:, None], gate_up, down)  # one pair per row
    back = a2a(y, send_n, recv_n)
    return torch.zeros(t, D, device=dev).index_add_(0, order // k, back).to(home)


def _expected_rows(x, idx, w, local: range):
    """This rank's dispatch as host lists: its pairs sorted by expert (stable in pair id) -> (xs, rw, offs)."""
    k = idx.shape[1]
    pairs = sorted((int(e), p) for p, e in enumerate(idx.reshape(-1).tolist()) if e in local)
    xs = torch.stack([x[p // k] for _, p in pairs]) if pairs else torch.zeros(0, D)
    rw = torch.tensor([float(w.reshape(-1)[p]) for _, p in pairs])
    counts = [sum(1 for e, _ in pairs if e == j) for j in local]
    return xs, rw, torch.tensor(counts).cumsum(0).to(torch.int32)


def _run_both(ctx, cases, k: int) -> dict[str, list[dict]]:
    """The cases through peer memory, then through the all-reduce fallback, in the same rank processes."""
    return {name: _run_cases(ctx, cases, k, peer) for name, peer in (("peer", True), ("all_reduce", False))}


def _run_cases(ctx, cases, k: int, peer: bool) -> list[dict]:
    cfg = preset("tiny")
    caps = AdmissionCaps(chunk_size=T_CAP, cached_tokens=4 * 16, max_requests=2)
    mem = PeerMemory.create(ctx, enabled=peer)
    pool = KVPool(cfg, 4, 16, ctx.device, alloc=mem.alloc, num_layers=1)
    rt = ComposeRuntime(ctx, pool, mem, caps)
    ex = ExpertExchange(rt, hidden=D, top_k=k, num_experts=E, dtype=torch.float32)
    assert ex.peer == peer
    local = expert_block(ctx.rank, ctx.world_size, E)
    dev = ctx.device
    gate_up, down = (v.to(dev) for v in _weights())
    ew = ExpertWeights(gate_up[local.start:local.stop].contiguous(), down[local.start:local.stop].contiguous())
    out = []
    for counts, route, seed in cases:
        x, idx, w = (v.to(dev) for v in _batch(counts, k, route, seed))
        o = sum(counts[: ctx.rank])
        mine = slice(o, o + counts[ctx.rank])
        ep = ex.plan_batch(counts)
        xs, offs, rw = ep.dispatch(x[mine], idx[mine], w[mine])
        got = ep.combine(grouped_swiglu(xs, offs, rw, ew))
        ref = all_to_all_reference(ctx, x[mine], idx[mine], w[mine], ew.gate_up, ew.down, local)
        whole = experts_loop(x, idx, w, gate_up, down)[mine]
        got, xs, offs, rw, ref, whole, x, idx, w = (v.cpu() for v in (got, xs, offs, rw, ref, whole, x, idx, w))
        want_xs, want_rw, want_offs = _expected_rows(x, idx, w, local)
        n = want_xs.shape[0]
        out.append({
            "shapes": (tuple(got.shape), tuple(xs.shape), ep.rows),
            "offs_equal": torch.equal(offs, want_offs),
            "rows_equal": torch.equal(xs[:n], want_xs) and torch.equal(rw[:n], want_rw),
            "padding_weight_zero": bool((rw[n:] == 0).all()),
            "padding_rows_zero": bool((xs[n:] == 0).all()),
            "vs_all_to_all": float((got - ref).abs().max()) if got.numel() else 0.0,
            "vs_one_process": float((got - whole).abs().max()) if got.numel() else 0.0,
            "scale": float(whole.abs().max()) if whole.numel() else 0.0,
            "rows_here": n, "gather": "triton" if ex.bases is not None else "torch",
        })
    ctx.barrier()
    rt.close()
    return out


# (counts per rank, routing, seed) at cp 4, k 3 > 2 experts per rank: ranks with no tokens; a rank alone; every
# token on experts 0..2 (ranks 2 and 3 get no rows); a full batch
CASES = [([5, 0, 7, 3], "random", 1), ([0, 0, 9, 0], "random", 2), ([4, 6, 0, 2], "low", 3),
         ([T_CAP - 3, 1, 0, 2], "random", 4)]
CP, K = 4, 3


def test_dispatch_combine_equal_all_to_all():
    _check(launch(_run_both, CP, args=(CASES, K), timeout_s=240))


@pytest.mark.cuda
@pytest.mark.triton
def test_dispatch_combine_on_the_gpu():
    """The same on CUDA: with peer memory the rows move through CUDA IPC, the page-gather kernel and GPU
    barrier rounds (ranks sharing one GPU, or one GPU each where there are 4)."""
    both = launch(_run_both, CP, device="cuda", args=(CASES, K), timeout_s=400)
    _check(both)
    assert {res["gather"] for b in both for res in b["peer"]} == {"triton"}


def _check(both: list[dict]) -> None:
    for transport in ("peer", "all_reduce"):
        empty_expert_ranks = 0
        for r, results in enumerate(b[transport] for b in both):
            for (counts, _, _), res in zip(CASES, results):
                rows = sum(counts) * min(K, E // CP)
                assert res["shapes"] == ((counts[r], D), (rows, D), rows), (transport, r, counts)
                assert res["offs_equal"] and res["rows_equal"] and res["padding_weight_zero"], (transport, r, counts)
                if transport == "peer" and res.get("gather") != "triton":  # the GPU kernel leaves padding unwritten
                    assert res["padding_rows_zero"], (r, counts)
                tol = 1e-5 * max(1.0, res["scale"])
                assert res["vs_all_to_all"] <= tol and res["vs_one_process"] <= tol, (transport, r, counts, res)
                empty_expert_ranks += res["rows_here"] == 0
        assert empty_expert_ranks >= 2  # the "low" batch leaves ranks 2 and 3 without rows


def test_prepare_checks_the_counts():
    ex = ExpertExchange.__new__(ExpertExchange)  # prepare reads only the group size and the token cap
    ex.cp, ex.chunk_tokens = 2, 8
    with pytest.raises(ValueError, match=r"expected 2 token counts >= 0 summing to at most 8 .*got \[3, 6\]"):
        ex.plan_batch([3, 6])
    for bad in ([3], [-1, 2]):
        with pytest.raises(ValueError, match="expected 2 token counts"):
            ex.plan_batch(bad)

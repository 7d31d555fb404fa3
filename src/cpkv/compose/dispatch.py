"""Expert parallelism: each token's hidden state to the ranks holding its top-k routed experts, and the
weighted expert outputs back to the token's rank (docs/design.md §6). No device->host synchronisation.

Rank r holds the El = E / cp routed experts [r El, (r + 1) El) (``cpkv.model.moe.expert_block``)::

    ex = ExpertExchange(rt, hidden=D, top_k=k, num_experts=E, dtype=dtype)  # collective, once (after rt)
    ep = ex.plan_batch(counts)               # per batch; counts[s] = query tokens of rank s (host ints)
    per MoE layer, every rank in the same order, also a rank with T = 0 (it serves its experts):
    xs, offs, rw = ep.dispatch(x [T, D], idx int64 [T, k], w float32 [T, k])          # barrier round 1
        xs [N, D] rows routed to this rank's experts, sorted by local expert; offs int32 [El] cumulative
        row ends (on the device); rw float32 [N] routing weights. Rows at or past offs[-1] are padding
        (weight 0): N = T_batch * min(k, El) is a static bound, the real count stays on the device.
    out = ep.combine(y [N, D])  -> [T, D]: each token's k weighted expert outputs summed  # round 2

Pairs. The batch's (token, j) pairs are numbered rank by rank, token by token: p = (O_s + t) k + j (O_s:
tokens of the ranks before s). Every rank reads every rank's idx and sorts all P = T_batch k pairs by
expert (stable): the same order everywhere, so rank q's rows are the run [bounds[q], bounds[q + 1]) of
the sorted pairs, already grouped by its local experts, and a token's rank finds the row of each of its
pairs in the owner's output (sorted position - bounds[owner]) without asking.

    dispatch on rank r: x, idx, w into its send region; round 1; every rank's idx and w read (P values);
        sort; its N rows' x gathered from their ranks' send regions (padding rows: zeros)
    combine on rank r: its N outputs into its return region; round 2; each own pair's output gathered
        from its expert's rank; the k of a token summed (one reduction, like ``moe.combine_pairs``)

Regions (per rank, in peer memory: /dev/shm on CPU, CUDA IPC on GPU; sized once from the admission caps,
T = ``chunk_tokens``, the chunk in whole pages, N = T min(k, El)): ``ep.x`` [T, D], ``ep.idx`` int32 [T, k],
``ep.w`` float32 [T, k], ``ep.y`` [N, D]. One copy of each, no parity halves, because every MoE
layer takes two rounds of the group's one counting barrier (``ComposeRuntime.barrier_round``):

- a rank rewrites its send regions (next MoE layer's dispatch) only after passing this layer's round 2,
  which needs every rank to have arrived there, and each arrives only after its reads of the send
  regions (the sort and the x gather come before its combine);
- a rank rewrites its return region (next layer's combine) only after passing the next layer's round 1,
  which every rank reaches only after this layer's combine gathers.

On the GPU those reads are kernels before the round's arrival on the same stream (the barrier kernel
orders them); with the host barrier the stream is drained before arriving; on the CPU ops are synchronous.
Compose rounds between MoE layers only add more such separations.

Row gathers from a table of ranks are the page-gather kernel on GPU with Triton (a row of D values is one
"page"); elsewhere a masked pure-torch gather (one pass per rank, no host read). Without peer memory
(``CPKV_DISABLE_PEER_MEMORY``) each rank all-reduces zero-padded copies instead: every value has one
producer, so the sum is exact (as ``batch-reduce`` compose).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
import torch.distributed as dist

from cpkv.kernels.page_gather.ref import SKIP
from cpkv.kernels.platform import use_triton
from cpkv.upload import upload

REGIONS = ("x", "idx", "w", "y")


class ExpertExchange:
    """One rank's expert-parallel regions and their readers (module docstring). Collective to build."""

    def __init__(self, rt: Any, *, hidden: int, top_k: int, num_experts: int, dtype: torch.dtype) -> None:
        self.rt, self.mem = rt, rt.mem
        self.rank, self.cp, self.device = rt.rank, rt.cp, rt.device
        if num_experts % self.cp:
            raise ValueError(f"cp {self.cp} must divide the routed experts {num_experts}")
        self.hidden, self.k, self.num_experts, self.dtype = hidden, top_k, num_experts, dtype
        self.local = num_experts // self.cp
        self.chunk_tokens = rt.caps.chunk_tokens(rt.page_size)
        self.pair_rows = self.chunk_tokens * min(top_k, self.local)
        self.peer = self.mem.available
        shapes = {"x": ((self.chunk_tokens, hidden), dtype), "idx": ((self.chunk_tokens, top_k), torch.int32),
                  "w": ((self.chunk_tokens, top_k), torch.float32), "y": ((self.pair_rows, hidden), dtype)}
        self.own = {n: self.mem.alloc(s, f"ep.{n}", d) for n, (s, d) in shapes.items()} if self.peer else {}
        self.mem.exchange()  # collective: every rank maps every rank's regions
        self.peers = {n: self.mem.peers(f"ep.{n}") for n in REGIONS} if self.peer else {}
        self.bases = self._bases() if self.peer and use_triton(self.device) else None

    def _bases(self) -> dict[str, tuple[torch.Tensor, bool]]:
        """Per row region (x, y): int64 [cp] addresses of every rank's region, and whether all rows are 16-byte
        aligned (the page-gather kernel's fast path)."""
        out = {}
        row = self.hidden * torch.empty((), dtype=self.dtype).element_size()
        for n in ("x", "y"):
            addrs = [t.data_ptr() for t in self.peers[n]]
            out[n] = (torch.tensor(addrs, dtype=torch.int64, device=self.device),
                      row % 16 == 0 and all(a % 16 == 0 for a in addrs))
        return out

    def plan_batch(self, counts: Sequence[int]) -> "EPBatch":
        """The batch's exchange: ``counts[s]`` query tokens on rank s (host ints, the same on every rank)."""
        if len(counts) != self.cp or min(counts) < 0 or sum(counts) > self.chunk_tokens:
            raise ValueError(f"expected {self.cp} token counts >= 0 summing to at most {self.chunk_tokens} (the chunk), "
                             f"got {list(counts)}")
        return EPBatch(self, [int(c) for c in counts])


    def gather_rows(self, name: str, src: torch.Tensor, row: torch.Tensor) -> torch.Tensor:
        """[n, D]: row ``row[i]`` of rank ``src[i]``'s region ``name`` (x or y); where src[i] < 0 zeros, or on the
        GPU (the page-gather kernel) for src[i] == SKIP whatever the buffer held (padding nobody reads: no
        write for it)."""
        n = src.shape[0]
        out = torch.empty(n, self.hidden, dtype=self.dtype, device=self.device)
        if n == 0:
            return out
        if self.bases is not None:
            from cpkv.kernels.page_gather.triton import page_gather_triton

            bases, aligned = self.bases[name]
            dest = torch.arange(n, dtype=torch.int64, device=self.device)
            page_gather_triton(out.view(torch.uint8), bases, dest, src, row, aligned16=aligned)
            return out
        out.zero_()  # (zeros for SKIP too, off the GPU)
        for s, region in enumerate(self.peers[name]):
            sel = src == s
            rows = region.index_select(0, torch.where(sel, row, 0))
            out = torch.where(sel[:, None], rows, out)
        return out

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        if self.cp > 1 and t.numel():
            dist.all_reduce(t, group=self.rt.ctx.group)
        return t


@dataclass
class _Sorted:
    """Between a layer's dispatch and combine: the global pair order and this rank's share of it."""

    order: torch.Tensor    # int64 [P]: pair ids sorted by expert
    bounds: torch.Tensor   # int64 [cp + 1]: rank q's rows are sorted pairs [bounds[q], bounds[q + 1])
    pair: torch.Tensor     # int64 [N]: the pair of each of this rank's rows (clamped on padding)
    valid: torch.Tensor    # bool [N]
    idx: torch.Tensor      # int64 [T, k]: this rank's own routing


@dataclass
class EPBatch:
    """One batch's exchange (``ExpertExchange.plan_batch``): token counts per rank, and the device tables every
    MoE layer of the batch uses (each token's rank and row), uploaded once without a host sync."""

    ex: ExpertExchange
    counts: list[int]
    offsets: list[int] = field(init=False)
    total: int = field(init=False)
    rows: int = field(init=False)            # N: this rank's static row count
    tok_rank: torch.Tensor = field(init=False)
    tok_row: torch.Tensor = field(init=False)
    arange: torch.Tensor = field(init=False)  # int64 [N]
    _sorted: _Sorted | None = field(init=False, default=None)
    _ids: torch.Tensor | None = field(init=False, default=None)  # [0, E) for the pair sort (_expert_ids)

    def __post_init__(self) -> None:
        ex = self.ex
        self.offsets = np.concatenate(([0], np.cumsum(self.counts))).tolist()
        self.total = self.offsets[-1]
        self.rows = self.total * min(ex.k, ex.local)
        ranks = np.repeat(np.arange(ex.cp, dtype=np.int64), self.counts)
        rows = np.arange(self.total, dtype=np.int64) - np.asarray(self.offsets[:-1], dtype=np.int64)[ranks]
        self.tok_rank = upload(torch.from_numpy(ranks), ex.device)
        self.tok_row = upload(torch.from_numpy(rows), ex.device)
        self.arange = torch.arange(self.rows, dtype=torch.int64, device=ex.device)

    @property
    def num_tokens(self) -> int:
        return self.counts[self.ex.rank]

    def dispatch(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [T, D], idx int64 [T, k], w float32 [T, k] (this rank's tokens) -> (xs [N, D], offs int32 [El],
        rw float32 [N]) for this rank's experts (module docstring)."""
        ex, t = self.ex, self.num_tokens
        if x.shape[0] != t or tuple(idx.shape) != (t, ex.k):
            raise ValueError(f"rank {ex.rank}: expected x [{t}, D] and idx [{t}, {ex.k}] (this batch's tokens here), "
                             f"got {list(x.shape)} and {list(idx.shape)}")
        idx_all, w_all, x_all = self._publish(x, idx, w)
        flat = idx_all.reshape(-1).long()
        # the stable order by expert on 16-bit keys (two radix passes where int64 takes eight) and each expert's
        # end as the number of keys <= it (the counts' cumulative sum without a scatter); model.moe.sort_pairs
        # sorts a single rank's pairs the same way
        keys, order = torch.sort(flat.to(torch.int16) if ex.num_experts <= 1 << 15 else flat, stable=True)
        ends = torch.searchsorted(keys, self._expert_ids(keys.dtype), right=True)
        bounds = torch.cat((ends.new_zeros(1), ends))[:: ex.local]
        lo, r = bounds[ex.rank], ex.rank
        q = lo + self.arange
        valid = q < bounds[r + 1]
        pair = order[q.clamp(max=max(flat.numel() - 1, 0))] if flat.numel() else q
        tok = pair // ex.k
        if x_all is None:  # padding rows (past offs[-1]) are left unwritten on the GPU: most of N at cp > 2
            xs = ex.gather_rows("x", torch.where(valid, self.tok_rank[tok], SKIP), self.tok_row[tok])
        else:
            xs = x_all.index_select(0, tok)
        rw = torch.where(valid, w_all.reshape(-1)[pair], 0.0) if flat.numel() else q.float()
        offs = (ends[r * ex.local:(r + 1) * ex.local] - lo).to(torch.int32)
        self._sorted = _Sorted(order, bounds, pair, valid, idx.long())
        return xs, offs, rw

    def _expert_ids(self, dtype: torch.dtype) -> torch.Tensor:
        """[0, E) as ``dtype`` on the exchange's device (made per batch, once: the batch's MoE layers share it)."""
        if self._ids is None or self._ids.dtype != dtype:
            self._ids = torch.arange(self.ex.num_experts, dtype=dtype, device=self.ex.device)
        return self._ids

    def _publish(self, x: torch.Tensor, idx: torch.Tensor, w: torch.Tensor):
        """Every rank's idx [T_batch, k] and w [T_batch, k], rank by rank (and, without peer memory, x)."""
        ex, r = self.ex, self.ex.rank
        t, o = self.num_tokens, self.offsets[r]
        if ex.peer:
            ex.own["x"][:t].copy_(x)
            ex.own["idx"][:t].copy_(idx)
            ex.own["w"][:t].copy_(w)
            ex.rt.barrier_round()  # round 1: every rank's send region is written
            cat = (lambda n: torch.cat([ex.peers[n][s][: c] for s, c in enumerate(self.counts)]))  # noqa: E731
            return cat("idx"), cat("w"), None
        outs = []
        for v, dtype in ((idx, torch.int32), (w, torch.float32), (x, ex.dtype)):
            buf = torch.zeros(self.total, *v.shape[1:], dtype=dtype, device=ex.device)
            buf[o:o + t] = v
            outs.append(ex.all_reduce(buf))
        return tuple(outs)

    def output_rows(self) -> torch.Tensor | None:
        """[N, D]: where this rank's expert outputs may be written for ``combine`` to find them without a copy
        (its return region in peer memory), or None without peer memory."""
        return self.ex.own["y"][: self.rows] if self.ex.peer else None

    def combine(self, y: torch.Tensor) -> torch.Tensor:
        """y [N, D]: this rank's weighted expert outputs (``dispatch``'s row order) -> [T, D] for this rank's
        tokens: each token's k outputs summed."""
        ex, s = self.ex, self._sorted
        if s is None:
            raise ValueError("combine without a dispatch before it (every MoE layer calls both, in order)")
        self._sorted = None
        t, o, k = self.num_tokens, self.offsets[ex.rank], ex.k
        p = o * k
        if ex.peer:
            region = ex.own["y"][: self.rows]
            if y.data_ptr() != region.data_ptr():  # (the grouped kernels wrote it in place: ``output_rows``)
                region.copy_(y)
            ex.rt.barrier_round()  # round 2: every rank's outputs are written
            inv = torch.empty_like(s.order).scatter_(0, s.order, torch.arange(s.order.numel(), device=ex.device))
            owner = s.idx.reshape(-1) // ex.local
            row = inv[p: p + t * k] - s.bounds[owner]
            got = ex.gather_rows("y", owner, row)
        else:
            flat = torch.zeros(self.total * k + 1, ex.hidden, dtype=ex.dtype, device=ex.device)
            flat.index_copy_(0, torch.where(s.valid, s.pair, self.total * k), y)  # padding -> the spare last row
            got = ex.all_reduce(flat)[p: p + t * k]
        return got.view(t, k, ex.hidden).sum(dim=1)

"""Small batches as CUDA graphs: the token-only pieces of every layer captured once per token bucket, replayed.

A batch of a few hundred tokens per rank is bound by the host (docs/design.md, "The host's pace"): launching
a layer costs it ~2.7 ms (dense) to ~4.5 ms (MoE) whatever the token count. Most of a layer depends on the
rank's token count alone, so that part is captured once per (layer, token bucket) and replayed in one launch:

    A  ``DSALayer.project``: norms, projections, RoPE, the rows' quantisation, the indexer's inputs   graph
       the row writes, compose, the dense KV, indexer top-k, sparse MLA (the key count varies)          eager
    C  ``DSALayer.finish``: W_UV, o_proj, residual + norm, the MLP or MoE                          graph
       under expert parallelism a MoE layer's C is R (``finish_routed``: C up to routing and the shared
       experts, graph) then its exchange, eager (``finish_experts``: the rounds count the group's barrier up)

The rank's T tokens run as the bucket's Tb >= T rows. The pieces read and write fixed buffers of
``max_tokens`` rows (each bucket a prefix of them, every layer the same ones); the eager part reads rows
[0, T) and writes the latent's rows [0, T) (and, for a MoE layer under expert parallelism, delta's). Rows [T, Tb) of the embedding, the rotary tables and the latent are
zeros at the batch's start: what the pad rows compute is finite, row by row (every op of A and C is row-wise:
per-row norms, per-row (1 x 128 block) quantisation, GEMMs, per-token routing), and never read back.

A piece runs eagerly the first time its (layer, bucket) is met, on the capture stream (JIT compiles,
autotuning, cuBLAS's workspace for that stream, first-use caches), and is captured right after; later batches
replay it. The engine meets them all before its first batch (``warm``, the largest bucket first). The graphs
share one memory pool: a piece's temporaries are dead when it ends, its results are copied into the fixed
buffers (the query is written there directly), and pieces run one at a time on one stream, so any order of
replays is safe.

Off CUDA, or with ``capture`` false, every piece runs eagerly through the same buffers and padding: the
protocol the tests check on CPU (and the GPU tests compare a replay with, byte for byte).
"""
from __future__ import annotations

import time
import weakref
from typing import Any

import torch

from cpkv.model.layer import Projected
from cpkv.model.ops import Rotary
from cpkv.timeline import paused

FIELDS = ("h", "token", "index", "iq", "iw")  # Projected's fields copied out of A (q is written in place)


def buckets(max_tokens: int) -> tuple[int, ...]:
    """The token buckets up to ``max_tokens``: 16, 32, 64, then powers of two and 1.5 x powers of two (a
    bucket's padding is under a third of it), ``max_tokens`` last."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    out, b = [], 16
    while b < max_tokens:
        out.append(b)
        if b >= 128 and b * 3 // 2 < max_tokens:
            out.append(b * 3 // 2)
        b *= 2
    return tuple(out) + (max_tokens,)


def bucket_of(t: int, sizes: tuple[int, ...]) -> int | None:
    """The smallest bucket holding ``t`` tokens (None: more than the largest)."""
    for b in sizes:
        if t <= b:
            return b
    return None


class LayerGraphs:
    """One model's fixed buffers and captured pieces (one per model and ``max_tokens``: ``for_model``)."""

    def __init__(self, model: Any, max_tokens: int, capture: bool | None = None) -> None:
        # weakly: for_model's table is keyed weakly by the model, and a strong reference here would keep every
        # model a process ever ran alive (a bench runs fp8 then bf16 weights of one model, one at a time)
        self._model, self.max_tokens = weakref.ref(model), max_tokens
        self.sizes = buckets(max_tokens)
        self.device = model.device
        self.capture = self.device.type == "cuda" if capture is None else capture
        if self.capture and self.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        cfg, dt, dev = model.cfg, model.dtype, self.device
        half = cfg.qk_rope_head_dim // 2
        z = lambda *shape, dtype=dt: torch.zeros(shape, dtype=dtype, device=dev)  # noqa: E731
        self.h, self.delta = z(max_tokens, cfg.hidden_size), z(max_tokens, cfg.hidden_size)
        self.latent = z(max_tokens, cfg.num_heads, cfg.kv_lora_rank)
        self.cos, self.sin = z(max_tokens, half, dtype=torch.float32), z(max_tokens, half, dtype=torch.float32)
        q_dtype = model.layers[0].query_dtype if model.layers else dt
        self.q = z(max_tokens, cfg.num_heads, cfg.kv_lora_rank + cfg.qk_rope_head_dim, dtype=q_dtype)
        self.out: dict[str, torch.Tensor] = {}  # A's other results, allocated at a piece's first (eager) run
        self.graphs: dict[tuple[int, str, int], Any] = {}
        self._routed: dict[tuple[int, str, int], torch.Tensor] = {}  # a MoE piece's routing (layer.routed after it)
        self.eager_runs = 0  # pieces run eagerly (each once, at its first use: a capture follows it)
        self.batches = 0     # batches run through the buffers
        self.warm_s = 0.0    # seconds ``warm`` took
        self.warm_bytes = 0  # device bytes ``warm`` left reserved: the captures' pool and the buffers it made
        self._init_bytes = self.nbytes()  # the buffers made here (A's other results come at its first run)
        self._pool = torch.cuda.graph_pool_handle() if self.capture else None
        self._stream = torch.cuda.Stream(dev) if self.capture else None

    @property
    def captured(self) -> int:
        return len(self.graphs)

    def bucket(self, t: int) -> int | None:
        """The bucket a batch of ``t`` tokens on this rank runs in (None: none, or t = 0: eager)."""
        return bucket_of(t, self.sizes) if t else None

    def nbytes(self) -> int:
        """Bytes of the fixed buffers (the pool's temporaries not included)."""
        ts = [self.h, self.delta, self.latent, self.cos, self.sin, self.q, *self.out.values()]
        return sum(t.numel() * t.element_size() for t in ts)

    # -- per batch -----------------------------------------------------------------------------------------
    def begin(self, h0: torch.Tensor, rot: Rotary) -> int:
        """A batch of T = len(h0) tokens: its embedding and rotary tables into the buffers, the pad rows of
        those and of the latent zeroed -> its bucket Tb."""
        t = h0.shape[0]
        tb = self.bucket(t)
        if tb is None:
            raise ValueError(f"a batch of {t} tokens is outside the graphs' buckets (1..{self.max_tokens})")
        self.h[:t].copy_(h0)
        self.cos[:t].copy_(rot.cos)
        self.sin[:t].copy_(rot.sin)
        if tb > t:
            for buf in (self.h, self.cos, self.sin, self.latent):
                buf[t:tb].zero_()
        self._t, self._tb = t, tb
        self.batches += 1
        return tb

    def counts(self) -> dict[str, int]:
        """Batches through the buffers, pieces captured and pieces run eagerly so far, the buffers' bytes, the seconds
        ``warm`` took, and the device bytes the graphs hold once warmed (buffers and pool)."""
        return {"batches": self.batches, "captured": self.captured, "eager_pieces": self.eager_runs,
                "buffer_bytes": self.nbytes(), "warm_s": round(self.warm_s, 3),
                "device_bytes": self._init_bytes + self.warm_bytes}

    def project(self, n: int, layer: Any) -> Projected:
        """Layer ``n``'s A piece over the bucket's rows -> its Projected over the batch's T rows (views of the
        fixed buffers; h is None: C reads it from the buffers)."""
        key = (n, "A", self._tb)
        g = self.graphs.get(key)
        if g is not None:
            g.replay()  # (the replay path builds no closure: this runs for every layer of every batch)
        else:
            self._run(key, self._project_piece(n, layer, self._tb))
        t = self._t
        view = lambda name: self.out[name][:t] if layer.full or name == "token" else None  # noqa: E731
        return Projected(self.q[:t], self.out["token"][:t], view("index"), view("iq"), view("iw"))

    def _project_piece(self, n: int, layer: Any, tb: int):
        def piece() -> None:
            rot = Rotary(self.cos[:tb], self.sin[:tb])
            p = layer.project(self.h[:tb], rot, self.delta[:tb] if n else None, q_out=self.q[:tb])
            for name in FIELDS:
                value = getattr(p, name)
                if value is not None:
                    self._buffer(name, value)[:tb].copy_(value)
        return piece

    def finish(self, n: int, layer: Any, latent: torch.Tensor, ep: Any = None) -> None:
        """Layer ``n``'s C piece: the batch's ``latent`` [T, H, kv_lora] into the buffer, then W_UV, o_proj,
        the residual and the MLP over the bucket's rows (h and delta updated in the buffers). A MoE layer under
        expert parallelism replays its R piece instead (C up to the exchange: routing and the shared experts) and
        runs the exchange eagerly over the batch's T rows (it was prepared with every rank's T, and its barrier
        rounds count up), adding the shared experts' output into delta."""
        t, tb = self._t, self._tb
        self.latent[:t].copy_(latent)
        if ep is not None and layer.is_moe:
            key, make = (n, "R", tb), self._routed_piece
        else:
            key, make = (n, "C", tb), self._finish_piece
        g = self.graphs.get(key)
        if g is not None:
            g.replay()
        else:
            self._run(key, make(layer, tb))
        if key in self._routed:  # the routing this piece wrote (its captured buffer: current after the replay)
            layer.routed = self._routed[key]
        if key[1] == "R":
            out = self.out
            layer.finish_experts(out["x"][:t], out["idx"][:t], out["rw"][:t],
                                 out["shared"][:t] if "shared" in out else None, ep, out=self.delta[:t])

    def _finish_piece(self, layer: Any, rows: int):
        def piece() -> None:
            h, out = layer.finish(self.out["h"][:rows], self.latent[:rows])
            self.h[:rows].copy_(h)
            self.delta[:rows].copy_(out)
            if layer.is_moe:
                self._routed[(layer.n, "C", rows)] = layer.routed
        return piece

    def _routed_piece(self, layer: Any, rows: int):
        def piece() -> None:
            h, x, idx, rw, shared = layer.finish_routed(self.out["h"][:rows], self.latent[:rows])
            self._routed[(layer.n, "R", rows)] = layer.routed
            self.h[:rows].copy_(h)
            for name, value in (("x", x), ("idx", idx), ("rw", rw), ("shared", shared)):
                if value is not None:
                    self._buffer(name, value)[:rows].copy_(value)
        return piece

    def warm(self) -> int:
        """Capture every layer's pieces at every bucket now, the largest bucket first (each piece runs once eagerly
        first, over whatever the buffers hold: their results are scratch) -> the pieces captured. In ascending
        order the pool grew with the sum of the buckets (each bucket's freed blocks too small for the next). The
        engine calls it before its first batch, so that no batch pays for a capture. Under expert parallelism a
        MoE layer's R piece is captured in place of its C. Nothing to do off CUDA."""
        if not self.capture:
            return 0
        model = self._model()
        ep = model.expert_parallel
        todo = []
        for tb in reversed(self.sizes):  # largest first: the smaller buckets' temporaries fit in its freed blocks
            for n, layer in enumerate(model.layers):
                todo.append(((n, "A", tb), self._project_piece(n, layer, tb)))
                if ep and layer.is_moe:
                    todo.append(((n, "R", tb), self._routed_piece(layer, tb)))
                else:
                    todo.append(((n, "C", tb), self._finish_piece(layer, tb)))
        todo = [(key, piece) for key, piece in todo if key not in self.graphs]
        if not todo:
            return 0
        t0, before = time.perf_counter(), self.captured
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()
        mem0 = torch.cuda.memory_reserved(self.device)
        for key, piece in todo:
            self._run(key, piece)
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the eager runs' blocks, cached for the capture stream alone, go back
        self.warm_s += time.perf_counter() - t0
        self.warm_bytes += torch.cuda.memory_reserved(self.device) - mem0  # the pool, and the buffers made here
        return self.captured - before

    def result(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(h, delta) [T, hidden] after the last layer: views of the buffers (read them before the next batch)."""
        return self.h[: self._t], self.delta[: self._t]

    # -- pieces --------------------------------------------------------------------------------------------
    def _buffer(self, name: str, like: torch.Tensor) -> torch.Tensor:
        buf = self.out.get(name)
        if buf is None or buf.shape[1:] != like.shape[1:] or buf.dtype != like.dtype:
            if buf is not None and self.capture and self.graphs:  # a captured graph writes the old address
                raise RuntimeError(f"the graph buffer {name!r} would change shape after a capture: "
                                   f"{tuple(buf.shape[1:])} {buf.dtype} to {tuple(like.shape[1:])} {like.dtype}")
            # (a buffer made for the first time after other captures is fine: no graph holds its address yet)
            buf = self.out[name] = torch.zeros((self.max_tokens,) + tuple(like.shape[1:]), dtype=like.dtype,
                                               device=self.device)
        return buf

    def _run(self, key: tuple[int, str, int], piece: Any) -> None:
        """A piece not captured yet: run it eagerly, then (CUDA) capture it."""
        self.eager_runs += 1
        if not self.capture:
            piece()
            return
        cur, s = torch.cuda.current_stream(self.device), self._stream
        s.wait_stream(cur)
        with torch.cuda.stream(s), paused():
            piece()  # this batch's results, and the kernels warmed on the capture stream
            g = torch.cuda.CUDAGraph()
            g.capture_begin(pool=self._pool, capture_error_mode="thread_local")
            try:
                piece()
            finally:
                g.capture_end()
            self.graphs[key] = g
        cur.wait_stream(s)


_MODELS: "weakref.WeakKeyDictionary[Any, LayerGraphs]" = weakref.WeakKeyDictionary()


def for_model(model: Any, max_tokens: int) -> LayerGraphs:
    """The model's LayerGraphs for ``max_tokens`` (made once: its captures serve every later run of the model)."""
    g = _MODELS.get(model)
    if g is None or g.max_tokens != max_tokens:
        g = _MODELS[model] = LayerGraphs(model, max_tokens)
    return g

"""``cpkv check compose``: every mode, real rank processes, byte-for-byte against the reference.

Each rank process builds a ComposeRuntime (pools and staging in peer memory), fills its pool with
seeded random bytes, and mirrors every rank's pool on the CPU. For each random batch (drawn identically
on every rank from the seed: 1..max_bs requests, empty and non-empty page-aligned prefixes, partial last
pages, a solo request with an unaligned prefix now and then, prefix pages owned by any rank and shared
between requests) and each mode, it writes its current rows, composes every (layer, kind), and compares
the dense buffer with :func:`reference_dense` built from the mirrored pools. It also checks that the
mode persisted the rank's current pages into its pool (the pages are scribbled over before each mode; a
group barrier at each batch start keeps that from hitting pages a slower peer still reads for the last batch).
``prefetch`` runs only on batches of one request; a check of ``prefetch`` alone draws only such batches, so
that each of its batches is composed. ``model`` gives the row sizes (``glm5``: 656-byte token rows, 132-byte
index rows), not the layer count.
"""
from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
import torch

from cpkv.compose.modes import get_mode, parse_modes
from cpkv.compose.reference import current_pages, reference_dense
from cpkv.compose.runtime import ComposeRuntime
from cpkv.config import COMPOSE_MODES, DEFAULT_PAGE_SIZE, KINDS, AdmissionCaps, CPConfig, ModelConfig, preset
from cpkv.dist import RankContext, launch
from cpkv.errors import ConfigError
from cpkv.layout import BatchLayout, build_layout

SCRIBBLE = 0xA5


@dataclass(frozen=True)
class CheckConfig:
    cp: int = 2
    modes: tuple[str, ...] = tuple(COMPOSE_MODES)
    batches: int = 6
    seed: int = 0
    device: str = "cpu"
    page_size: int = DEFAULT_PAGE_SIZE
    layers: int = 3
    model: str = "tiny"
    pages_per_rank: int = 160
    max_bs: int = 4
    max_prefix_pages: int = 6
    max_extend_pages: int = 5
    timeout_s: float = 600.0
    corrupt_mode: str | None = None  # fault injection (tests): rank 0 flips one byte of this mode's output

    def __post_init__(self) -> None:
        """Validate before any rank process starts."""
        CPConfig(self.cp, self.page_size)  # validates cp and page_size
        for key in ("batches", "layers", "pages_per_rank", "max_bs", "max_prefix_pages", "max_extend_pages"):
            if not isinstance(getattr(self, key), int) or getattr(self, key) < 1:
                raise ConfigError(f"{key} must be an integer >= 1, got {getattr(self, key)!r}")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ConfigError(f"seed must be an integer >= 0, got {self.seed!r}")
        if not self.modes:
            raise ConfigError("modes: expected at least one compose mode, got none")
        for mode in self.modes:
            get_mode(mode)  # raises ComposeError naming the supported modes
        if self.device not in ("cpu", "cuda"):
            raise ConfigError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if not self.timeout_s > 0:
            raise ConfigError(f"timeout_s must be > 0, got {self.timeout_s}")
        preset(self.model)  # raises ConfigError naming the presets

    @property
    def solo_only(self) -> bool:
        """Only ``prefetch`` is checked: every batch is a single request (the only batches it runs)."""
        return self.modes == ("prefetch",)

    def caps(self) -> AdmissionCaps:
        ext = self.max_bs * self.max_extend_pages * self.page_size
        return AdmissionCaps(chunk_size=ext, cached_tokens=self.max_bs * self.max_prefix_pages * self.page_size,
                             buffer_bytes=1 << 30, max_requests=self.max_bs)


# batches ------------------------------------------------------------------------------------------

def draw_batch(cfg: CheckConfig, b: int) -> tuple[BatchLayout, list[int]]:
    """Batch ``b`` (identical on every rank) and a writer-side pool page id per current page."""
    rng = np.random.default_rng([cfg.seed, b, 7])
    P, cp = cfg.page_size, cfg.cp
    solo = b % 3 == 0 or cfg.solo_only
    bs = 1 if solo else int(rng.integers(2, cfg.max_bs + 1))
    reqs, pages = [], []
    for i in range(bs):
        npp = int(rng.integers(0, cfg.max_prefix_pages + 1)) if rng.random() > 0.25 else 0
        prefix = npp * P
        if solo and b % 6 == 3 and npp and P > 1:
            prefix -= int(rng.integers(1, P))  # unaligned prefix: partial last prefix page (solo only)
        extend = int(rng.integers(1, cfg.max_extend_pages * P + 1))
        if i > 0 and pages[0] and rng.random() < 0.3 and npp:
            own = pages[0][: npp] + [(int(rng.integers(0, cp)), int(rng.integers(1, cfg.pages_per_rank)))
                                     for _ in range(max(0, npp - len(pages[0])))]  # shared prefix pages
        else:
            own = [(int(rng.integers(0, cp)), int(rng.integers(1, cfg.pages_per_rank))) for _ in range(npp)]
        reqs.append((prefix, extend))
        pages.append(own)
    layout = build_layout(reqs, page_size=P, cp=cp, prefix_pages=pages)
    return layout, _current_ids(rng, layout, cfg)


def _current_ids(rng: np.random.Generator, layout: BatchLayout, cfg: CheckConfig) -> list[int]:
    used: list[set[int]] = [set() for _ in range(cfg.cp)]
    for p in layout.logical_pages:
        if p.kind == "prefix":
            used[p.rank].add(p.page_id)
    free = [rng.permutation([x for x in range(1, cfg.pages_per_rank) if x not in used[r]]) for r in range(cfg.cp)]
    taken = [0] * cfg.cp
    ids = []
    for c in layout.current_pages:
        ids.append(int(free[c.writer][taken[c.writer]]))
        taken[c.writer] += 1
    return ids


def _bytes(shape: tuple[int, ...], *key: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(int(np.random.default_rng(list(key)).integers(0, 2 ** 62)))
    return torch.randint(0, 256, shape, dtype=torch.uint8, generator=g)


def initial_pool(cfg: CheckConfig, model: ModelConfig, rank: int, kind: str) -> torch.Tensor:
    """uint8 [layers of kind, pages, P * row_bytes]: rank ``rank``'s seeded pool contents."""
    return _bytes((len(model.layers_of(kind)), cfg.pages_per_rank, cfg.page_size * model.row_bytes(kind)),
                  cfg.seed, rank, KINDS.index(kind), 11)


def batch_current(cfg: CheckConfig, model: ModelConfig, layout: BatchLayout, b: int, layer: int,
                  kind: str) -> torch.Tensor:
    """uint8 [num_current, P * row_bytes]: the batch's current pages of (layer, kind), zero tails."""
    rows = _bytes((layout.extend_tokens, model.row_bytes(kind)), cfg.seed, b, layer, KINDS.index(kind), 13)
    return current_pages(layout, rows)


# the rank worker ----------------------------------------------------------------------------------

class _Stats:
    def __init__(self) -> None:
        self.bytes = self.mismatches = self.batches = 0
        self.sha = hashlib.sha256()
        self.effective = ""

    def add(self, dense: torch.Tensor, ref: torch.Tensor) -> None:
        self.bytes += dense.numel()
        self.mismatches += int((dense != ref).sum())
        self.sha.update(dense.numpy().tobytes())


def rank_worker(ctx: RankContext, cfg: CheckConfig) -> dict[str, Any]:
    """One rank of the check: returns per mode {bytes, mismatches, digest, batches, effective}."""
    model = preset(cfg.model).with_layers(cfg.layers)  # shared indexer layers compose token rows only
    rt = ComposeRuntime.create(ctx, model, num_pages=cfg.pages_per_rank, page_size=cfg.page_size, caps=cfg.caps(),
                               num_layers=cfg.layers)
    for k in KINDS:
        rt.pool.buffers[k].copy_(initial_pool(cfg, model, ctx.rank, k))
    _sync(rt)
    ctx.barrier()
    mirror = {k: [initial_pool(cfg, model, r, k) for r in range(cfg.cp)] for k in KINDS}
    stats = {m: _Stats() for m in cfg.modes}
    solo = 0
    for b in range(cfg.batches):
        layout, ids = draw_batch(cfg, b)
        plan = rt.plan_batch(layout, ids)
        _fence_batch(ctx, rt)
        solo += len(layout.requests) == 1
        for mode in cfg.modes:
            if mode == "prefetch" and len(layout.requests) != 1:
                continue
            _run_mode(rt, cfg, model, layout, plan, b, mode, mirror, stats[mode])
        _update_mirror(cfg, model, layout, ids, b, mirror)
        if ctx.rank == 0:
            ctx.report(b + 1)  # batches done (the parent's progress line)
    rt.close()
    return {"modes": {m: {"bytes": s.bytes, "mismatches": s.mismatches, "digest": s.sha.hexdigest(),
                          "batches": s.batches, "effective": s.effective} for m, s in stats.items()},
            "peer_memory": rt.mem.kind, "solo_batches": solo, "prefetch_hits": rt.prefetch_hits,
            "backend": ctx.backend, "shared_device": ctx.shared_device}


def _run_mode(rt: ComposeRuntime, cfg: CheckConfig, model: ModelConfig, layout: BatchLayout, plan, b: int,
              mode: str, mirror: dict, st: _Stats) -> None:
    own = torch.from_numpy(plan.current_page_ids[plan.own_compact]) if plan.num_own else None
    for k in KINDS:
        if own is not None:
            rt.pool.buffers[k][:, own.to(rt.device)] = SCRIBBLE
    st.batches += 1
    st.effective = rt.effective_mode(mode)
    for layer in range(cfg.layers):
        per_layer = layer % 2 == 1  # odd layers: every kind at once (compose_layer), even layers: kind by kind
        cur, dense_all = {}, {}
        for k in model.kinds_at(layer):
            cur[k] = batch_current(cfg, model, layout, b, layer, k)
            rows = rt.current_rows(plan, layer, k)
            mine = cur[k][torch.from_numpy(plan.own_compact)].view(-1, model.row_bytes(k)).to(rt.device)
            rows.index_copy_(0, plan.query_rows, mine.index_select(0, plan.query_rows))
            if not per_layer:
                dense_all[k] = rt.compose(plan, layer, k, mode=mode)
        if per_layer:
            dense_all = rt.compose_layer(plan, layer, mode=mode)
        for k in model.kinds_at(layer):
            dense = dense_all[k].cpu()
            if cfg.corrupt_mode == mode and rt.rank == 0 and layer == 0:
                dense = dense.clone()
                dense.view(-1)[0] ^= 1
            slot = rt.pool.slot(layer, k)
            st.add(dense, reference_dense(layout, [m[slot] for m in mirror[k]], cur[k]))
            if own is not None:
                got = rt.pool.pages(layer, k)[own.to(rt.device)].cpu()
                st.mismatches += int((got != cur[k][torch.from_numpy(plan.own_compact)]).sum())


def _update_mirror(cfg: CheckConfig, model: ModelConfig, layout: BatchLayout, ids: list[int], b: int,
                   mirror: dict) -> None:
    for layer in range(cfg.layers):
        for k in model.kinds_at(layer):
            cur = batch_current(cfg, model, layout, b, layer, k)
            for c in layout.current_pages:
                mirror[k][c.writer][model.layers_of(k).index(layer)][ids[c.compact]] = cur[c.compact]


def _fence_batch(ctx: RankContext, rt: ComposeRuntime) -> None:
    """Group barrier before a batch's first mode: every rank has finished the previous batch. The modes
    scribble over this rank's current pool pages, and a current page of this batch may be a prefix page of
    the previous one that a slower peer is still gathering (its last gather follows its last barrier round,
    which this rank has passed too). The engine writes a batch's current pages only in ``persist``, after
    that batch's first barrier round or collective; its host-tier reloads synchronise on their own
    (``BatchExecutor._fence_reload``)."""
    _sync(rt)
    ctx.barrier()


def _sync(rt: ComposeRuntime) -> None:
    if rt.device.type == "cuda":
        torch.cuda.synchronize(rt.device)


# the parent ---------------------------------------------------------------------------------------

def run_check(cfg: CheckConfig, on_progress=None) -> dict[str, Any]:
    """Launch ``cfg.cp`` ranks, run the check, aggregate: {"ok", "modes": {name: {...}}, ...}.
    ``on_progress(batches_done)`` is called as rank 0 finishes each batch."""
    parse_modes(",".join(cfg.modes))
    report = (lambda rank, done: on_progress(done)) if on_progress else None
    results = launch(rank_worker, cfg.cp, device=cfg.device, args=(cfg,), timeout_s=cfg.timeout_s,
                     on_progress=report)
    return aggregate(cfg, results)


def aggregate(cfg: CheckConfig, results: list[dict[str, Any]]) -> dict[str, Any]:
    modes = {}
    for m in cfg.modes:
        per = [r["modes"][m] for r in results]
        digests = {p["digest"] for p in per}
        mism = sum(p["mismatches"] for p in per) + (0 if len(digests) == 1 else 1)
        modes[m] = {"digest": per[0]["digest"], "mismatches": mism, "bytes": sum(p["bytes"] for p in per),
                    "batches": per[0]["batches"], "effective": per[0]["effective"],
                    "ranks_agree": len(digests) == 1}
    ok = all(v["mismatches"] == 0 and v["batches"] > 0 for v in modes.values())
    r0 = results[0]
    return {"ok": ok, "modes": modes, "cp": cfg.cp, "device": cfg.device, "batches": cfg.batches,
            "seed": cfg.seed, "page_size": cfg.page_size, "layers": cfg.layers, "peer_memory": r0["peer_memory"],
            "backend": r0["backend"], "shared_device": r0["shared_device"], "solo_batches": r0["solo_batches"],
            "prefetch_hits": [r["prefetch_hits"] for r in results], "config": asdict(cfg)}

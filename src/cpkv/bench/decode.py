"""``cpkv bench decode``: the paged decode step (docs/design.md §11) per batch and context, against its floor.

Per context length L (``--keys``) one prompt of L tokens is prefilled once (its pages kept, as the online engine
keeps a generation's) and cloned page for page, on the same owners, into B generations (``--batches``): each clone
holds its own copy of the KV under its own keys, so a step reads B contexts as B real generations would (their
top-k selections alike). Then ``--steps`` decode steps of all B are timed (each to its end: the device
synchronised, the tokens agreed between the ranks), after two untimed ones: ``sync_step_ms``, their median. Where the
runner pipelines (the graphs form at cp 1: ``DecodeRunner.launch``), ``4 x --steps`` more run as a serving loop
would: each step launched before the last one's tokens are read, its input tokens taken on the device;
``pipelined_ms`` is the time between consecutive steps' tokens reaching the host in that loop (the steady state,
after two), the time per output token a greedy generation sees. ``step_ms`` is the pipelined time where it runs,
else the synchronised one.

Each clone decodes its own next token, so the B generations route as B real ones would, not alike.

The floor is the bytes the busiest rank's step must read, at the copy rate measured in the same run (``copy_``'s
bytes read + written per second: the rate of a memory stream): the weights it keeps (the embedding table's B rows
only, and W_UK / W_UV in place of kv_b_proj), the routed experts its step served (the union over the ranks of each
MoE layer's routed experts, among those it holds: counted after the step, outside the timing), the context's index
rows on the full layers and top-k token rows per layer of the generations it runs. ``ratio_to_floor`` = step time
/ floor time. ``--weights fp8,bf16`` runs each mode in its own rank processes.

Each case checks what it timed (``--no-check`` skips it), outside the timing and without changing the timed
steps: generation 0's logits of the first and the last timed synchronised step (``runner.run``'s; at cp > 1 they
live on whichever rank computed them, and are gathered to rank 0) against the model's own single-process reference
forward over that generation's tokens so far (``DSAModel.reference_prefill``, cut at the prefill's chunks and at
every decoded token, as the decode tests run it), computed on rank 0 only: at cp 1 by the rank's own model, at
cp > 1 by a full model (every routed expert) that rank 0 loads once. ``check_max_diff``: the largest |logit
difference| of the ``check_steps`` checked steps; ``check_tol``: that step's tolerance (``CHECK_TOL``: the decode
tests' CPU and CUDA tolerances). Where the whole step is one graph (the graphs form), the step's own discrete
decisions for generation 0 (each full layer's top-k selection, each MoE layer's experts, with the scores they were
picked from: ``step_decisions``) are forced on the reference (``check_forced``), as ``cpkv run``'s verification
forces a run's (``engine.taps.Forced``): the logits then compare numerics only, and ``check_decisions`` counts the
decisions that differed and those beyond twice the measured score noise (unexplained: the check fails); the other
forms are compared unforced. ``check_greedy``: the greedy token is the reference's wherever the reference's top
two logits differ by more than the tolerance (a discrete choice may flip on rounding noise elsewhere;
``check_greedy_compared``: the tokens so compared), the last token the pipelined loop picked on the device included
where it runs (``check_pipelined_greedy``); ``check_ok``: every checked step within its tolerance, and greedy. A
token sequence's reference is computed once per rank process (the forms and batches usually decode generation 0
alike). ``cpkv bench decode`` exits 1 when a case's check fails, one line on stderr naming the failed cases
(``cpkv bench engine --decode`` does not check). Test hook: ``--plant-fault stale-bounds`` (hidden from
``--help``) makes the in-place forms' steps reuse the top-k bounds their first step per batch bucket made (the bug
a graphs step's replays once had), so the check must fail.

    cpkv bench decode --model glm5 --num-layers 4 --cp 2 --device cuda --keys 1024,32768,131072 --batches 1,8,32
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from typing import Any

HELP = "The paged decode step per batch and context, against the bytes it must read at the copy rate."

# The check's tolerance per device, as the decode tests hold the step to its reference (tests/engine/test_decode.py):
# (absolute, relative to the reference's largest |logit|)
CHECK_TOL = {"cpu": (0.01, 0.01), "cuda": (0.05, 0.05)}
FAULTS = ("stale-bounds",)  # ``--plant-fault``: test hooks only (module docstring)


def check_tolerance(device: str, largest: float) -> float:
    """The check's tolerance on ``device`` for a reference whose largest |logit| is ``largest`` (``CHECK_TOL``)."""
    a, r = CHECK_TOL["cuda" if device.startswith("cuda") else "cpu"]
    return a + r * largest


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv.cli.args import bounded_int, positive_int

    p.add_argument("--model", default="tiny", help="preset or checkpoint dir (default tiny)")
    p.add_argument("--num-layers", type=positive_int, default=None, help="override the model's depth")
    p.add_argument("--cp", type=positive_int, default=1, help="rank processes (default 1)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--page-size", type=positive_int, default=64)
    p.add_argument("--keys", default="256,1024", help="comma-separated context lengths (default 256,1024)")
    p.add_argument("--batches", default="1,4", help="comma-separated generations per step (default 1,4)")
    p.add_argument("--steps", type=positive_int, default=5, help="timed steps per case (default 5)")
    p.add_argument("--weights", default="auto",
                   help="comma-separated weights modes, each run in its own rank processes: auto, fp8, bf16 "
                        "(default auto: fp8 on CUDA)")
    p.add_argument("--form", default="auto",
                   help="comma-separated decode step forms to time in the same rank processes: auto, graphs, static, "
                        "gather (CPKV_DECODE_STEP; default auto)")
    p.add_argument("--graph-tokens", type=bounded_int(0, 1 << 16), default=None, metavar="N",
                   help="steps of up to this many generations per rank run each layer's token-only pieces as CUDA "
                        "graphs (default: the engine's, 1024 on CUDA; 0 = eager)")
    p.add_argument("--chunk-size", type=positive_int, default=None,
                   help="prefill chunk (default: the toy or model size preset's)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after each case's timed steps, one more step under torch's profiler on rank 0: its kernel "
                        "and host-op table (top 40 by device time, then by host time) written to DIR")
    p.add_argument("--no-check", dest="check", action="store_false",
                   help="skip the check of each case's steps against the model's reference forward (module docstring)")
    p.add_argument("--plant-fault", choices=FAULTS, default=None, help=argparse.SUPPRESS)  # a test hook
    p.add_argument("--json", action="store_true")


def _ints(text: str, flag: str) -> list[int]:
    from cpkv.errors import ConfigError

    try:
        out = [int(x) for x in text.split(",") if x]
    except ValueError:
        out = []
    if not out or min(out) < 1:
        raise ConfigError(f"{flag}: expected comma-separated integers >= 1, got {text!r}")
    return out


def run(args: argparse.Namespace) -> int:
    keys, batches = _ints(args.keys, "--keys"), _ints(args.batches, "--batches")
    rows, graph_tokens = decode_cases(args.model, args.num_layers, None, args.cp, args.device, args.page_size, keys,
                                      batches, args.steps, weights_list(args.weights), args.graph_tokens,
                                      args.chunk_size, args.profile, forms_list(args.form), check=args.check,
                                      fault=args.plant_fault)
    report = {"model": args.model, "cp": args.cp, "device": args.device, "graph_tokens": graph_tokens,
              "cases": rows}
    _print(report, args.json)
    failed = [r for r in rows if r.get("check_ok") is False]
    if failed:
        print("cpkv bench decode: check failed: " + "; ".join(
            f"{r['weights']} {r['form']} keys {r['keys']} batch {r['batch']} (max |logit diff| "
            f"{r['check_max_diff']:.4g}, tol {r['check_tol']:.4g}, greedy {r['check_greedy']})" for r in failed),
            file=sys.stderr)
        return 1
    return 0


def decode_cases(model: str, num_layers: int | None, experts: int | None, cp: int, device: str, page_size: int,
                 keys: list[int], batches: list[int], steps: int, weights: list[str], graph_tokens: int | None = None,
                 chunk_size: int | None = None, profile: str | None = None,
                 forms: list[str] | None = None, check: bool = False,
                 fault: str | None = None) -> tuple[list[dict], int]:
    """Every (weights, keys, batch) case in fresh rank processes per weights mode -> (rank 0's rows, each with its
    ``weights``; the graph tokens they ran with). ``cpkv bench decode``'s cases, and ``cpkv bench engine
    --decode``'s. ``check``: each case checked against the reference (module docstring); ``fault``: a planted
    fault (tests only)."""
    from cpkv.config import SIZES
    from cpkv.dist import launch
    from cpkv.engine.config import EngineConfig, default_graph_tokens

    P = page_size
    sizes = SIZES["model" if device == "cuda" else "toy"]
    chunk = chunk_size or max(P, sizes.chunk_size // P * P)
    need = max(batches) * (max(keys) // P + 2 + steps // P + 2) + max(keys) // P + 4  # clones + the source
    rows, tokens = [], default_graph_tokens(device, graph_tokens)
    for w in weights:
        cfg = EngineConfig(model=model, num_layers=num_layers, experts=experts, cp=cp, device=device, page_size=P,
                           pages_per_rank=-(-need // cp) + 8, chunk_size=chunk, max_requests=1, look_ahead=False,
                           weights=w, graph_tokens=tokens)
        got = launch(decode_bench_rank, cp, args=(cfg, keys, batches, steps, profile, forms or ["auto"], check, fault),
                     device=device, timeout_s=3600)[0]
        rows += [{"weights": cfg.weights_dtype, **r} for r in got]
    return rows, tokens


def weights_list(spec: str) -> list[str]:
    """``--weights`` -> distinct modes in order (ConfigError naming the flag on a bad value)."""
    from cpkv.cli.args import choice_list
    from cpkv.model.config import WEIGHTS_MODES

    return choice_list(spec, "--weights", WEIGHTS_MODES)


def forms_list(spec: str) -> list[str]:
    """``--form`` -> distinct forms in order (ConfigError naming the flag on a bad value)."""
    from cpkv.cli.args import choice_list
    from cpkv.envs import DECODE_STEPS

    return choice_list(spec, "--form", DECODE_STEPS)


def decode_bench_rank(ctx, cfg, keys: list[int], batches: list[int], steps: int,
                      profile: str | None = None, forms: tuple[str, ...] = ("auto",), check: bool = False,
                      fault: str | None = None) -> list[dict]:
    """Every (keys, batch) case on this rank -> rank 0's rows (module docstring); ``check``: each checked against
    the reference on rank 0; ``fault``: a planted fault (``FAULTS``)."""
    from cpkv.bench.timing import copy_gbs
    from cpkv.engine.decode import DecodeRunner
    from cpkv.engine.executor import BatchExecutor
    from cpkv.engine.instruments import NoInstruments
    from cpkv.engine.rank import rank_model
    from cpkv.scheduler.decode import Decoder

    unplant = _plant(fault)
    model = rank_model(ctx, cfg)
    ex = BatchExecutor(ctx, cfg, model, NoInstruments())
    checker = _Checker(ctx, cfg, model) if check else None
    # a checked graphs step keeps its decisions' buffers (held to each graph's end: memory, no work)
    runners = {f: DecodeRunner(model, ex.rt, ex.ep, ctx.rank, ex.graphs, form=f, keep_decisions=check)
               for f in forms}
    rate = copy_gbs(device=cfg.device) * 1e9  # the copy rate (read + written bytes per second): a memory stream's
    shared = _ranks_share_gpu(cfg)
    out = []
    try:
        for n in keys:
            source = _prefill(ex, ctx, model, n)
            for b in batches:
                for form, runner in runners.items():
                    dec = Decoder(ex.kv, cfg.cp, cfg.page_size)
                    for g in range(b):
                        _clone(ex, dec, source, g, model.cfg.vocab_size)
                    watch = GEN0 if checker is not None else None
                    times, floor, experts, total, seen = _time_steps(ex, ctx, dec, runner, model, steps, watch)
                    synced = times
                    if runner.pipelined:
                        times = _time_pipelined(ex, dec, runner, 4 * steps)
                    checked = checker.check(source[0], dec.seqs[GEN0].tokens, seen, runner.pipelined) if watch else {}
                    if profile:
                        _profile_step(ex, ctx, dec, runner, model,
                                      f"{profile}/decode_{form}_k{n}_b{b}_r{ctx.rank}.txt")
                    for rid in list(dec.seqs):
                        dec.finish(rid)
                    out.append({"keys": n, "batch": b, "form": runner.form, "step_ms": times * 1e3,
                                "sync_step_ms": synced * 1e3, "pipelined": runner.pipelined,
                                "floor_ms": floor / rate * 1e3, "floor_bytes": floor, "copy_gbs": rate / 1e9,
                                "ratio_to_floor": times * rate / floor, "experts_read": experts,
                                "ranks_share_gpu": shared, **checked})
                    if shared:  # one memory system serves every rank's bytes (an upper bound on the read: the
                        # busiest rank's count of experts taken for each rank)
                        out[-1].update(shared_floor_ms=total / rate * 1e3, ratio_to_shared_floor=times * rate / total)
                    if ctx.rank == 0:  # each case as it ends: a run stopped early keeps what it measured
                        print("case " + json.dumps({"weights": cfg.weights_dtype, **out[-1]}), file=sys.stderr,
                              flush=True)
            ex.kv.drop(source[1])
            ex.kv.release(source[2])
    finally:
        ex.close()
        unplant()
    return out


GEN0 = ("gen", 0)  # the generation a case checks


def _plant(fault: str | None):
    """Plant ``fault`` in this rank process (``FAULTS``, module docstring) -> the function that removes it.
    "stale-bounds": ``StepInputs.bounds`` returns the tensors it made at its first call per batch bucket (the
    top-k ranges of that step's contexts), as a step reusing state kept from its warm-up would."""
    if fault is None:
        return lambda: None
    from cpkv.engine.decode_graph import StepInputs

    real, first = StepInputs.bounds, {}

    def stale(self):
        key = (self.B, str(self.all.device))
        if key not in first:
            first[key] = real(self)
        return first[key]

    StepInputs.bounds = stale

    def unplant() -> None:
        StepInputs.bounds = real

    return unplant


def step_decisions(kept: dict, row: int) -> dict:
    """The discrete decisions the last graphs-form step took for its entry ``row`` (``kept``: its
    ``StepGraphs.decisions``, current after its replay) -> {"route": {MoE layer: (int64 [k] experts, float32 [k]
    their choice values)}, "select": {full layer: (int32 [top-k] context positions, -1 none; float32 [top-k] their
    indexer logits, NaN for none)}} on the host. Syncs: outside the timing."""
    import numpy as np
    import torch

    out: dict = {"route": {}, "select": {}}
    for n, d in sorted(kept.items()):
        if d.get("route_choice") is not None:
            ids = d["routed"][row].long()
            out["route"][n] = (ids.cpu().numpy(), d["route_choice"][row].gather(0, ids).float().cpu().numpy())
        if d.get("selected") is not None:
            pos = d["selected"][row].long()
            vals = torch.where(pos >= 0, d["index_logits"][row].gather(0, pos.clamp(min=0)), float("nan"))
            out["select"][n] = (pos.cpu().numpy().astype(np.int32), vals.float().cpu().numpy())
    return out


def _digest(decisions: dict | None) -> str | None:
    """A key of ``step_decisions``' arrays (the reference cache's: a sequence under other decisions is another)."""
    if decisions is None:
        return None
    import hashlib

    h = hashlib.sha1()
    for kind in ("route", "select"):
        for n in sorted(decisions[kind]):
            h.update(f"{kind}{n}".encode())
            for a in decisions[kind][n]:
                h.update(a.tobytes())
    return h.hexdigest()


class _OneRow:
    """An array of ``n`` rows, each ``fill`` but row ``row`` (``value``: its contents), made a window of rows at a
    time as the ``Forced`` tap reads it (``a[start:end]``); ``narrow``: a window without the row comes back one
    column wide (the tap broadcasts it against its own decisions there, which it keeps: a 131,072-token reference
    need not hold [n, top-k] arrays for one row)."""

    def __init__(self, n: int, row: int, value, fill, narrow: bool = False) -> None:
        import numpy as np

        self.n, self.row, self.value, self.fill, self.narrow = n, row, np.asarray(value), fill, narrow

    def __getitem__(self, rows: slice):
        import numpy as np

        start, stop, _ = rows.indices(self.n)
        if not start <= self.row < stop and self.narrow and self.value.ndim:
            return np.full((stop - start, 1), self.fill, self.value.dtype)
        out = np.full((stop - start, *self.value.shape), self.fill, self.value.dtype)
        if start <= self.row < stop:
            out[self.row - start] = self.value
        return out


def _forced(decisions: dict, n: int, device: str):
    """The ``Forced`` tap that puts ``decisions`` (``step_decisions``: the step's at position ``n`` - 1) on the
    reference of ``n`` tokens; every other position keeps the reference's own (counted as unforced)."""
    import numpy as np

    from cpkv.engine.taps import Forced

    last = n - 1
    route = {ln: (_OneRow(n, last, ids, -1), _OneRow(n, last, vals, np.nan))
             for ln, (ids, vals) in decisions["route"].items()}
    select = {ln: (_OneRow(n, last, pos, -1, narrow=True), _OneRow(n, last, vals, np.nan, narrow=True),
                   _OneRow(n, last, True, False)) for ln, (pos, vals) in decisions["select"].items()}
    return Forced(route, select, "cuda" if device == "cuda" else "cpu")


class _Checker:
    """A case's check (module docstring): generation 0's checked steps against the model's reference forward on
    rank 0. Every rank calls ``check`` (the logits are gathered to rank 0); it syncs, so it runs outside the
    timing."""

    def __init__(self, ctx, cfg, model) -> None:
        self.ctx, self.cfg, self.model = ctx, cfg, model
        self.device = model.device.type
        self.ref = None
        self.cache: dict[tuple[int, ...], Any] = {}  # token sequence -> its reference logits (CPU)
        self.chunk = cfg.chunk_size

    def _reference_model(self):
        """The rank's own model where it holds every routed expert (cp 1), else a full one loaded once."""
        if self.ref is None:
            whole = all(len(layer.experts) == self.model.cfg.n_routed_experts for layer in self.model.layers)
            if whole:
                self.ref = self.model
            else:
                from cpkv.model import load_model

                cfg = self.cfg
                self.ref = load_model(cfg.model, seed=cfg.seed, device=self.model.device, num_layers=cfg.num_layers,
                                      precision=cfg.precision, weights=cfg.weights_dtype, routed_experts=cfg.experts)
        return self.ref

    def reference(self, tokens: list[int], prompt: int, decisions: dict | None = None):
        """-> (float32 [vocab] on the CPU: the reference's logits of ``tokens``' last token, the prompt's ``prompt``
        tokens cut at the prefill's chunks and every later token its own chunk (as the engine ran them), with
        ``decisions`` (``step_decisions``: the step's, at the last token) forced on it; the ``Forced`` tap's counts
        or None)."""
        key = (tuple(tokens), _digest(decisions))
        if key not in self.cache:
            ref = self._reference_model()
            kept = [layer.routed for layer in ref.layers]  # the bench's floor reads the step's routing there
            tap = None if decisions is None else _forced(decisions, len(tokens), self.device)
            try:
                cuts = [*range(self.chunk, prompt, self.chunk), *range(prompt, len(tokens))]
                got = ref.reference_prefill(tokens, cuts=cuts, tap=tap).float().cpu()
                self.cache[key] = (got, None if tap is None else tap.summary())
            finally:
                for layer, r in zip(ref.layers, kept):
                    layer.routed = r
        return self.cache[key]

    def check(self, prompt: list[int], seq: list[int], seen: list, pipelined: bool) -> dict:
        """``seen``: this rank's (context length, logits or None, its decisions or None: ``step_decisions``) per
        checked step of generation 0, ``seq`` its tokens now (its first one the clone's key, not the source's: the
        source's ``prompt`` is what its KV holds) -> rank 0's check fields (every other rank: {})."""
        import torch

        from cpkv.engine.taps import INDEX_MARGIN, ROUTE_MARGIN, DecisionCount

        if self.ctx.world_size > 1:
            parts = self.ctx.all_gather_object([None if v is None else (v.numpy(), d) for _, v, d in seen])
            seen = [(n, *next(((torch.from_numpy(p[i][0]), p[i][1]) for p in parts if p[i] is not None),
                              (None, None))) for i, (n, _, _) in enumerate(seen)]
        out: dict = {}
        if self.ctx.rank == 0:
            tokens = list(prompt) + list(seq[len(prompt):])
            worst, within, greedy, compared = None, True, True, 0
            counts = {"route": DecisionCount(), "index": DecisionCount()}
            forced = all(d is not None for _, _, d in seen)
            for n, got, decisions in seen:
                want, summary = self.reference(tokens[:n], len(prompt), decisions if forced else None)
                for kind, count in (summary or {}).items():
                    counts[kind].merge(count)
                tol = check_tolerance(self.device, float(want.abs().max()))
                if got is None:
                    raise RuntimeError(f"decode check: no rank computed generation 0's logits at context {n}")
                diff = float((got - want).abs().max())
                within &= diff <= tol
                if worst is None or diff > worst[0]:
                    worst = (diff, tol)
                ok, agreed = self._greedy(want, tokens[n], tol)
                compared += ok
                greedy &= agreed
            out = {"check_steps": len(seen), "check_max_diff": worst[0],
                   "check_tol": worst[1], "check_forced": forced}
            if forced:
                dev = "cuda" if self.device == "cuda" else "cpu"
                out["check_decisions"] = {"route": counts["route"].to_json(ROUTE_MARGIN[dev]),
                                          "index": counts["index"].to_json(INDEX_MARGIN[dev])}
                within &= counts["route"].unexplained == 0 and counts["index"].unexplained == 0
            if pipelined:  # the last token the pipelined loop picked on the device
                want = self.reference(tokens[:-1], len(prompt))[0]
                ok, agreed = self._greedy(want, tokens[-1], check_tolerance(self.device, float(want.abs().max())))
                compared += ok
                out["check_pipelined_greedy"] = agreed
                greedy &= agreed
            out.update(check_greedy=greedy, check_greedy_compared=compared, check_ok=within and greedy)
        self.ctx.all_reduce_max_list([0])  # the other ranks wait here (a collective), not in the next case's steps
        return out

    @staticmethod
    def _greedy(want, token: int, tol: float) -> tuple[bool, bool]:
        """(compared: the reference's top two differ by more than ``tol``, agreed: not compared or ``token`` is its
        argmax)."""
        import torch

        top2 = torch.topk(want, 2).values
        if float(top2[0] - top2[1]) <= tol:
            return False, True
        return True, int(want.argmax()) == token


def _ranks_share_gpu(cfg) -> bool:
    """The ranks run on fewer GPUs than there are ranks (their steps then share one memory system: the floor of
    the busiest rank's bytes is not the step's, the sum of the ranks' is)."""
    import torch

    return cfg.device == "cuda" and cfg.cp > torch.cuda.device_count()


def _prefill(ex, ctx, model, n: int):
    """One prompt of ``n`` tokens prefilled with its pages kept -> (tokens, its held prefix, its tail pages)."""
    import random

    from cpkv.scheduler import Request

    rng = random.Random(n)
    tokens = [rng.randrange(model.cfg.vocab_size) for _ in range(n)]
    req = Request(("source", n), tokens, n)
    req.keep = True
    ex.sched.add(req)
    while ex.sched.has_work:
        ex.run(ex.sched.next_batch())
    return tokens, req.prefix, req.tail


def _clone(ex, dec, source, g: int, vocab: int) -> None:
    """Generation ``g``: a copy of the source's pages on the same owners (each rank copies its own), its full pages
    cached under keys of its own, started in ``dec`` with a next token to decode."""
    tokens, prefix, tail = source
    pages = prefix.pages + tuple(tail)
    got = ex.kv.allocate([o for o, _ in pages])
    assert got is not None, "the bench sized the pool for every clone"
    pool = ex.rt.pool
    for (o, src), (_, dst) in zip(pages, got):
        if o == ex.rank:
            for buf in pool.buffers.values():
                buf[:, dst].copy_(buf[:, src])
    keys = [(g + 1 + i) % vocab if i == 0 else t for i, t in enumerate(tokens)]
    full = len(prefix)
    held = ex.kv.commit(keys[: full * pool.page_size], ex.kv.match([]), got[:full], hold=True)
    # each generation decodes its own next token (the source's last one, shifted by g): their hidden states, and so
    # their routings, differ as real generations' do (identical clones would route alike and read few experts)
    dec.start(("gen", g), keys + [(keys[-1] + g) % vocab], held, got[full:])


def _step(ctx, dec, runner):
    """One decode step of every generation in ``dec``, greedy, its tokens agreed between the ranks -> (the step,
    this rank's {rid: logits})."""
    import torch

    step, failed = dec.plan()
    assert step is not None and not failed
    logits = runner.run(step)
    mine = [e.rid for e in step.entries if e.rid in logits]
    top = torch.stack([logits[r] for r in mine]).argmax(-1).tolist() if mine else []  # one sync
    got = dict(zip(mine, top))
    tokens = ctx.all_reduce_max_list([got.get(e.rid, -1) for e in step.entries])
    for e, t in zip(step.entries, tokens):
        dec.seqs[e.rid].tokens.append(t)
        dec.advance(e.rid)
    return step, logits


def _time_pipelined(ex, dec, runner, steps: int) -> float:
    """Seconds between consecutive steps' tokens reaching the host when each step is launched before the last one's
    tokens are read (module docstring), over ``steps`` after two; greedy, cp 1."""
    ex.sync_time()
    pending, marks = None, []

    def read(got) -> None:
        for rid, tok in got.tokens().items():
            dec.seqs[rid].tokens.append(tok)
        marks.append(time.perf_counter())

    for _ in range(steps + 3):
        step, failed = dec.plan()
        assert step is not None and not failed
        got = runner.launch(step)
        if pending is not None:
            read(pending)
        for e in step.entries:
            dec.advance(e.rid)
        pending = got
    read(pending)
    ex.sync_time()
    return (marks[-1] - marks[2]) / (len(marks) - 3)


def _profile_step(ex, ctx, dec, runner, model, path: str) -> None:
    """One more step under torch's profiler; rank 0 writes its tables to ``path``."""
    import os

    import torch
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if model.device.type == "cuda" else [])
    ex.sync_time()
    with profile(activities=acts) as prof:
        _step(ctx, dec, runner)
        ex.sync_time()
    if ctx.rank == 0:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        ka = prof.key_averages()
        by_dev = "cuda_time_total" if model.device.type == "cuda" else "cpu_time_total"
        with open(path, "w") as f:
            f.write(ka.table(sort_by=by_dev, row_limit=40) + "\n\n")
            f.write(ka.table(sort_by="self_cpu_time_total", row_limit=40) + "\n")


def _time_steps(ex, ctx, dec, runner, model, steps: int, watch=None) -> tuple[float, float, int, float, list]:
    """(median seconds per step, floor bytes of the busiest rank's step, the routed experts it read, the ranks'
    floor bytes summed, ``watch``'s checked steps) over two untimed and ``steps`` timed steps. ``watch``: a
    generation whose logits of the first and the last timed step are kept, after the step's timing, as (its
    context length, float32 [vocab] on the CPU, or None where another rank computed them; the step's decisions for
    it where the whole step ran as one graph, ``step_decisions``, else None)."""
    times, floor, experts, total, seen = [], 0.0, 0, 0.0, []
    kept = ("fp8" if model.weights_dtype == "fp8" else "bf16", str(model.dtype).removeprefix("torch."))
    for s in range(steps + 2):
        t0 = ex.sync_time()
        step, logits = _step(ctx, dec, runner)
        t1 = ex.sync_time()
        mine = [e.rid for e in step.on(ctx.rank)]
        # the whole step one graph: its decisions are that graph's buffers (``StepGraphs.decisions``)
        graphed = runner.form == "graphs" and runner.ep is None and runner.step_graphs.fits(len(mine))
        if watch is not None and s in (2, steps + 1):
            got = logits.get(watch)
            decisions = step_decisions(runner.step_graphs.decisions, mine.index(watch)) \
                if got is not None and graphed else None
            seen.append((len(dec.seqs[watch].tokens) - 1, None if got is None else got.float().cpu(), decisions))
        logits = None  # not held through the next timed step
        if s >= 2:
            times.append(t1 - t0)
            routing = {n: d["routed"] for n, d in runner.step_graphs.decisions.items() if "routed" in d} \
                if graphed else None
            read = routed_experts_read(ctx, model, len(mine), routing)
            each = [step_floor(step, model.cfg, r, *kept, experts_read=read) for r in range(step.cp)]
            if max(each) > floor:
                floor, experts, total = max(each), read, sum(each)
    times.sort()
    return times[len(times) // 2], floor, experts, total, seen


def routed_experts_read(ctx, model, own: int, routing: dict | None = None) -> int:
    """(MoE layer, routed expert) pairs the busiest rank's experts served in the last step: the union over the ranks
    of the experts their tokens were routed to (each MoE layer's ``routed``, or ``routing[layer]`` for a step that
    ran as one graph: that graph's buffer; this rank's ``own`` tokens' rows), counted among the experts each rank
    holds; the maximum over the ranks. Syncs: call outside the timing."""
    import torch

    moe = [layer for layer in model.layers if layer.is_moe]
    if not moe:
        return 0
    n = model.cfg.n_routed_experts
    mask = torch.zeros((len(moe), n), dtype=torch.int64)
    for i, layer in enumerate(moe):
        routed = layer.routed if routing is None else routing.get(layer.n)
        if own and routed is not None:
            mask[i, routed[:own].reshape(-1).long().cpu()] = 1
    union = torch.tensor(ctx.all_reduce_max_list(mask.reshape(-1).tolist())).view(len(moe), n)
    mine = sum(int(union[i, list(layer.experts)].sum()) for i, layer in enumerate(moe))
    return max(ctx.all_reduce_max_list([mine]))


def step_floor(step, m, rank: int, weights: str, compute: str, experts_read: int | None = None) -> float:
    """Bytes ``rank``'s share of ``step`` must read (module docstring); ``weights``: "fp8" or "bf16" (the compute
    dtype), ``compute``: "bfloat16" or "float32"; ``experts_read``: the (MoE layer, routed expert) pairs its step
    read (``routed_experts_read``), else the most its tokens can reach, min(local experts, B x top-k) per layer."""
    from cpkv.memplan import DTYPE_BYTES, weight_bytes

    wb = weight_bytes(m, weights, compute)
    el = DTYPE_BYTES[compute]
    b = len(step.entries)
    kv_b = m.num_layers * m.num_heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank * el
    weights_read = wb.replicated - m.vocab_size * m.hidden_size * el - kv_b + b * m.hidden_size * el
    local = math.ceil(m.n_routed_experts / step.cp)
    pairs = experts_read if experts_read is not None else min(local, b * m.num_experts_per_tok) * wb.moe_layers
    experts = pairs * wb.expert
    full = m.indexer_types.count("full")
    mine = step.on(rank)
    kv = sum(e.context * m.row_bytes("index") * full + min(e.context, m.index_topk) * m.row_bytes("token") *
             m.num_layers for e in mine)
    return weights_read + experts + kv


def _print(rep: dict, as_json: bool) -> None:
    from cpkv.cli.fmt import emit_json

    if as_json:
        emit_json(rep)
        return
    print_cases(rep["cases"])
    print(f"\n{rep['model']} at cp {rep['cp']} on {rep['device']}: time per paged decode step of every "
          f"generation (pipelined: launched before the last step's tokens are read; synced: each to its end, tokens "
          f"agreed); floor: the busiest rank's bytes at the copy rate of this run")


def print_cases(cases: list[dict]) -> None:
    """The decode cases' table."""
    from cpkv.cli.fmt import table

    table(("weights", "form", "keys", "batch", "step ms", "synced ms", "floor ms", "floor MB", "experts read",
           "ratio to floor", "ratio, GPU shared", "check (max diff / tol)"),
          [(r["weights"], r.get("form", "") + (" pipelined" if r.get("pipelined") else ""), r["keys"], r["batch"],
            f"{r['step_ms']:.3f}", f"{r.get('sync_step_ms', r['step_ms']):.3f}", f"{r['floor_ms']:.3f}",
            f"{r['floor_bytes'] / 1e6:.1f}", r["experts_read"], f"{r['ratio_to_floor']:.2f}",
            f"{r['ratio_to_shared_floor']:.2f}" if "ratio_to_shared_floor" in r else "", _check_cell(r))
           for r in cases])


def _check_cell(r: dict) -> str:
    """A row's check as its table cell: ok / FAIL, the max |logit diff| / the tolerance ("" unchecked)."""
    if "check_ok" not in r:
        return ""
    greedy = "" if r["check_greedy"] else ", greedy differs"
    return f"{'ok' if r['check_ok'] else 'FAIL'} {r['check_max_diff']:.3g} / {r['check_tol']:.3g}{greedy}"

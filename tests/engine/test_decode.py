"""The paged decode step (cpkv.engine.decode) against the single-process reference: a generation's tokens decoded
one step at a time over the KV where it lies, at cp 1, 2 and 4, with contexts past the tiny model's top-k (64)."""
from __future__ import annotations

import pytest
import torch

from cpkv.dist import launch
from cpkv.engine.config import EngineConfig

pytestmark = pytest.mark.slow

PAGE = 16
NEW = 6


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 37 + 11 * i) % 500 + 3 for i in range(n)]


def _decode_ranks(ctx, cfg: EngineConfig, prompts: list[list[int]], new: int, form: str = "gather"):
    """Prefill every prompt (kept for decoding), then ``new`` paged decode steps of all of them together ->
    (tokens per generation, per step {rid: logits} of the generations that ran, gathered on every rank). On CUDA
    each step's plan and forward after the first (which may capture the step's graphs) run under torch's sync
    debug mode set to error: no device->host sync. ``form``: the DecodeRunner's."""
    import contextlib

    from cpkv.engine.instruments import sync_debug_error
    from cpkv.engine.decode import DecodeRunner
    from cpkv.engine.executor import BatchExecutor
    from cpkv.engine.instruments import NoInstruments
    from cpkv.engine.rank import rank_model
    from cpkv.scheduler import Request
    from cpkv.scheduler.decode import Decoder

    model = rank_model(ctx, cfg)
    ex = BatchExecutor(ctx, cfg, model, NoInstruments())
    dec = Decoder(ex.kv, cfg.cp, cfg.page_size)
    runner = DecodeRunner(model, ex.rt, ex.ep, ctx.rank, ex.graphs, form=form)
    gens = {i: list(p) for i, p in enumerate(prompts)}
    for i, p in enumerate(prompts):
        req = Request(i, list(p), len(p))
        req.keep = True
        ex.sched.add(req)
    while ex.sched.has_work:
        res = ex.run(ex.sched.next_batch())
        toks = ctx.all_reduce_max_list([int(res.logits[r.rid].argmax()) if r.rid in res.logits else -1
                                        for r in res.finished])
        for r, t in zip(res.finished, toks):
            gens[r.rid].append(t)
            dec.start(r.rid, gens[r.rid], r.prefix, r.tail)
    steps = []
    before = ex.graphs.counts()["batches"] if ex.graphs is not None else 0
    for i in range(new):
        step, failed = dec.plan()
        assert not failed
        with sync_debug_error() if ctx.device.type == "cuda" and i else contextlib.nullcontext():
            logits = runner.run(step)
        toks = ctx.all_reduce_max_list([int(logits[e.rid].argmax()) if e.rid in logits else -1
                                        for e in step.entries])
        mine = {rid: v.cpu().numpy().copy() for rid, v in logits.items()}  # plain arrays through the pipes
        steps.append({k: v for part in ctx.all_gather_object(mine) for k, v in part.items()})
        for e, t in zip(step.entries, toks):
            gens[e.rid].append(t)
            dec.advance(e.rid)
    for rid in list(dec.seqs):
        dec.finish(rid)
    ex.close()
    graphed = ex.graphs.counts()["batches"] - before if ex.graphs is not None else 0  # steps through the buffers
    if runner.step_graphs is not None:
        graphed = runner.step_graphs.replays
    return gens, steps, ex.kv.pages_used(), graphed


@pytest.fixture(scope="module")
def reference():
    from cpkv.model import load_model
    return load_model("tiny", seed=0)


def _run(cp: int, prompts: list[list[int]], new: int = NEW, device: str = "cpu", graph_tokens: int = 0,
         precision: str = "fp8", form: str = "gather"):
    cfg = EngineConfig(cp=cp, page_size=PAGE, pages_per_rank=64, chunk_size=256, max_requests=4, device=device,
                       graph_tokens=graph_tokens, precision=precision)
    return launch(_decode_ranks, cp, args=(cfg, prompts, new, form), device=device, timeout_s=600)[0]


@pytest.mark.parametrize("precision", ["fp8", "exact"])
def test_one_generation_at_cp1_is_the_reference_run_token_by_token_bit_for_bit(precision):
    """cp 1, one generation: each step's logits equal the reference run as one-token chunks after the prompt
    (the same ops at the same row counts) exactly, fp8 rows or exact ones; its tokens are the reference's greedy
    ones."""
    from cpkv.model import load_model

    reference = load_model("tiny", seed=0, precision=precision)
    prompt = _prompt(1, 93)  # 93 > top-k 64: the indexer selects; the steps cross the page boundary at 96
    gens, steps, _, _ = _run(1, [prompt], precision=precision)
    seq = gens[0]
    for s, got in enumerate(steps):
        n = len(prompt) + 1 + s  # tokens in the context of step s's logits
        want = reference.reference_prefill(seq[:n], cuts=list(range(len(prompt), n)))
        assert torch.equal(torch.from_numpy(got[0]), want), \
            f"step {s}: max |diff| {(torch.from_numpy(got[0]) - want).abs().max()}"
        assert int(want.argmax()) == seq[n]


def _assert_reference_greedy(reference, prompts, gens, steps) -> None:
    """Every generation ran every step; each token is the reference prefill's greedy token for the prompt plus the
    tokens before it, each step's logits within the CPU tolerance (0.01 + 1 % of the largest |logit|)."""
    for rid, prompt in enumerate(prompts):
        seq = gens[rid]
        assert len(seq) == len(prompt) + 1 + len(steps)
        for s, got in enumerate(steps):
            n = len(prompt) + 1 + s
            want = reference.reference_prefill(seq[:n])
            assert int(want.argmax()) == seq[n], (rid, s)
            assert float((torch.from_numpy(got[rid]) - want).abs().max()) <= 0.01 + 0.01 * float(want.abs().max())


@pytest.mark.parametrize("cp", [1, 2, 4])
def test_batched_generations_decode_the_reference_greedy_tokens(reference, cp):
    """Several generations (short, at the top-k, past it; over page boundaries) advance together; each token is
    the reference prefill's greedy token for the prompt plus the tokens before it (the tokens ``cpkv run``
    gives), and the logits agree within the CPU tolerance."""
    prompts = [_prompt(2, 20), _prompt(3, 63), _prompt(4, 100), _prompt(5, 47)]
    gens, steps, used, _ = _run(cp, prompts)
    assert len(steps) == NEW
    _assert_reference_greedy(reference, prompts, gens, steps)
    # finished: every full page stays cached (its owner's), every tail page went back
    assert sum(used) == sum((len(gens[r]) - 1) // PAGE for r in gens)


@pytest.mark.parametrize("cp,form,graph_tokens", [(1, "static", 0), (2, "static", 0), (2, "static", 64),
                                                    (1, "graphs", 0)])
def test_static_step_decodes_the_reference_greedy_tokens(reference, cp, form, graph_tokens):
    """The attention read in place ("static": the gather step's structure, the layers' token-only pieces through the
    layer graphs' buffers with graph_tokens; the paged references read the rows through the table; contexts below,
    at and past the top-k in one step, so short ones select every key) gives each generation the reference's greedy
    tokens, its logits within the CPU tolerance. "graphs" on the CPU: the fixed-shape step
    (``engine.decode_graph.step_forward``), three generations padded to the bucket of 4 (the fourth a copy of the
    first, writing the same rows), run eagerly."""
    prompts = [_prompt(2, 20), _prompt(3, 63), _prompt(4, 100)]
    gens, steps, _, graphed = _run(cp, prompts, form=form, graph_tokens=graph_tokens)
    assert graphed == (NEW if form == "graphs" or graph_tokens else 0) and len(steps) == NEW
    _assert_reference_greedy(reference, prompts, gens, steps)


def test_steps_through_the_layer_graphs_buffers_decode_the_same_tokens(reference):
    """graph_tokens on (on the CPU: the graphs' fixed buffers and padding, run eagerly): every step's token-only
    pieces run as their bucket's 16 rows, and the tokens are still the reference's greedy ones."""
    prompts = [_prompt(6, 70), _prompt(7, 30)]
    gens, steps, _, graphed = _run(2, prompts, graph_tokens=64)
    assert graphed == NEW  # rank 0 runs both generations' steps here (their tail pages' owner), all through them
    _assert_reference_greedy(reference, prompts, gens, steps)


@pytest.mark.cuda
@pytest.mark.triton
@pytest.mark.parametrize("cp,form", [(1, "gather"), (2, "gather"), (1, "graphs"), (2, "static")])
def test_gpu_decode_steps_sync_free_and_close_to_the_reference_run_token_by_token(cp, form):
    """CUDA (fp8 rows, the Triton kernels, the layers' captured pieces; at cp 2 both ranks on one GPU): each step's
    plan and forward run without a device->host sync, its logits are within the GPU tolerance of the reference run with a cut at every decoded
    token, and its token is that reference's greedy one wherever the reference's top two differ by more than it."""
    from cpkv.model import load_model

    prompts = [_prompt(2, 20), _prompt(4, 100), _prompt(1, 93)]
    gens, steps, _, graphed = _run(cp, prompts, device="cuda", graph_tokens=64, form=form)
    assert graphed == NEW or cp > 1  # at cp 1 every step replays the captured pieces, or the whole step's graph
    model = load_model("tiny", seed=0, device="cuda")
    for rid, prompt in enumerate(prompts):
        seq = gens[rid]
        for s, got in enumerate(steps):
            n = len(prompt) + 1 + s
            want = model.reference_prefill(seq[:n], cuts=list(range(len(prompt), n))).float().cpu()
            tol = 0.05 + 0.05 * float(want.abs().max())
            assert float((torch.from_numpy(got[rid]) - want).abs().max()) <= tol, (rid, s)
            top2 = torch.topk(want, 2).values
            if float(top2[0] - top2[1]) > tol:
                assert int(want.argmax()) == seq[n], (rid, s)


def test_decode_forms_resolve_and_refuse_exact_rows_in_place():
    """"auto" is gather on the CPU (no kernels); an in-place form over exact rows is a ConfigError naming the
    variable, before any step runs."""
    from cpkv.engine.decode import resolve_form
    from cpkv.errors import ConfigError
    from cpkv.model import load_model

    fp8, exact = load_model("tiny", seed=0), load_model("tiny", seed=0, precision="exact")
    assert resolve_form("auto", fp8, None) == "gather" and resolve_form("static", fp8, None) == "static"
    assert resolve_form("auto", exact, None) == "gather" and resolve_form("gather", exact, None) == "gather"
    for form in ("static", "graphs"):
        with pytest.raises(ConfigError, match="CPKV_DECODE_STEP"):
            resolve_form(form, exact, None)


def _pipelined_ranks(ctx, cfg: EngineConfig, prompts: list[list[int]], budgets: list[int], late: int,
                     pipelined: bool = True, sampled: dict | None = None, host: bool = False):
    """Prefill every prompt (kept), then decode them greedily with the graphs form: generation i makes
    ``budgets[i]`` tokens after its first and stops, the last one starts ``late`` steps after the others.
    ``pipelined``: each step is launched before the previous one's tokens are read (``DecodeRunner.launch``: its
    input tokens pending on the device); else each step runs and is read in turn. ``sampled``: {rid:
    SamplingParams} of the generations whose tokens the graph samples (``launch``'s draw, keyed by each token's
    index); ``host`` (not pipelined): each step's logits read instead (``runner.run``) and every token picked on the
    host (``sampling.pick``). -> (tokens per generation, launched steps, pages used at the end)."""
    from cpkv.engine import sampling
    from cpkv.engine.protocol import SamplingParams, mix_seed
    from cpkv.engine.decode import DecodeRunner
    from cpkv.engine.executor import BatchExecutor
    from cpkv.engine.instruments import NoInstruments
    from cpkv.engine.rank import rank_model
    from cpkv.scheduler import Request
    from cpkv.scheduler.decode import Decoder

    model = rank_model(ctx, cfg)
    ex = BatchExecutor(ctx, cfg, model, NoInstruments())
    dec = Decoder(ex.kv, cfg.cp, cfg.page_size)
    runner = DecodeRunner(model, ex.rt, ex.ep, ctx.rank, ex.graphs, form="graphs")
    assert runner.pipelined
    gens, kept = {i: list(p) for i, p in enumerate(prompts)}, {}
    for i, p in enumerate(prompts):
        req = Request(i, list(p), len(p))
        req.keep = True
        ex.sched.add(req)
    while ex.sched.has_work:
        res = ex.run(ex.sched.next_batch())
        for r in res.finished:
            gens[r.rid].append(int(res.logits[r.rid].argmax()))
            kept[r.rid] = r
    waiting = len(prompts) - 1
    for rid in range(waiting):
        dec.start(rid, gens[rid], kept[rid].prefix, kept[rid].tail)
    made = {rid: 0 for rid in gens}
    pending, launched = None, 0

    def read(got) -> None:  # a step's tokens reach the host: appended, and a generation at its budget stops
        for rid, tok in got.tokens().items():
            if rid not in dec.seqs:
                continue  # stopped at the step before: this step ran past its end, its token is dropped
            gens[rid].append(tok)
            made[rid] += 1
            if made[rid] >= budgets[rid]:
                dec.finish(rid)

    def draws(step) -> dict | None:  # each entry's sampling row, keyed by the index of the token it picks
        if not sampled:
            return None
        ahead = set(pending.rids) if pending is not None else set()
        out = {}
        for e in step.entries:
            p = sampled.get(e.rid, SamplingParams())
            out[e.rid] = (p.top_k, mix_seed(p.seed, made[e.rid] + 1 + (e.rid in ahead)), p.temperature, p.top_p,
                          p.min_p)
        return out

    class Picked:  # the host's picks of a step, read as a launched step's tokens
        def __init__(self, tokens: dict) -> None:
            self._t = tokens

        def tokens(self) -> dict:
            return self._t

    while len(dec) or pending is not None or waiting < len(prompts):
        if launched == late and waiting < len(prompts):
            dec.start(waiting, gens[waiting], kept[waiting].prefix, kept[waiting].tail)
            waiting += 1
        step, failed = dec.plan()
        assert not failed
        if host and step is not None:
            logits = runner.run(step)
            got = Picked({e.rid: sampling.pick(logits[e.rid], (sampled or {}).get(e.rid, SamplingParams()),
                                               gens[e.rid], len(prompts[e.rid]), made[e.rid] + 1)
                          for e in step.entries})
        else:
            got = runner.launch(step, draws(step)) if step is not None else None
        launched += step is not None
        if not pipelined and got is not None:  # each step read before the next is planned
            for e in step.entries:
                dec.advance(e.rid)
            read(got)
            continue
        if pending is not None:
            read(pending)
        if step is not None:
            for e in step.entries:
                if e.rid in dec.seqs:
                    dec.advance(e.rid)
        pending = got
    # a server's runner keeps no decision buffers but each MoE layer's routing ([B, k]: a floor's count)
    assert all(set(d) <= {"routed"} for d in runner.step_graphs.decisions.values()), runner.step_graphs.decisions
    ex.close()
    return gens, launched, ex.kv.pages_used()


@pytest.mark.parametrize("pipelined", [True, False])
def test_pipelined_steps_decode_the_reference_greedy_tokens(reference, pipelined):
    """The graphs form's greedy tokens picked on the device (CPU: the fixed-shape step run eagerly): launched one
    step ahead of the host, each step's inputs pending on the device, generations stopping at different steps and
    one joining late, every token is the reference prefill's greedy token for the prompt plus the tokens before
    it, every generation makes exactly its budget, and the finished generations hold no tail page."""
    prompts = [_prompt(2, 20), _prompt(3, 63), _prompt(4, 100), _prompt(5, 45)]
    budgets = [3, 6, 1, 4]
    cfg = EngineConfig(cp=1, page_size=PAGE, pages_per_rank=64, chunk_size=256, max_requests=4)
    gens, launched, used = launch(_pipelined_ranks, 1, args=(cfg, prompts, budgets, 2, pipelined), device="cpu",
                                  timeout_s=600)[0]
    for rid, prompt in enumerate(prompts):
        seq = gens[rid]
        assert len(seq) == len(prompt) + 1 + budgets[rid], rid
        for n in range(len(prompt) + 1, len(seq)):
            assert int(reference.reference_prefill(seq[:n]).argmax()) == seq[n], (rid, n)
    # the steps: 6 for the longest budget, the late one's 4 from step 2 on, pipelined one step past each stop
    assert launched == (7 if pipelined else 6)
    # every stored token's full pages stay cached (a stopped generation's last token has its KV stored, a step run
    # past its stop does not count), every tail page went back
    assert sum(used) == sum((len(gens[r]) - 1) // PAGE for r in gens)


@pytest.mark.cuda
@pytest.mark.triton
def test_gpu_pipelined_loop_decodes_the_synchronised_loops_tokens():
    """CUDA, the step's graphs: the pipelined loop (each step's input tokens pending on the device) decodes exactly
    the tokens of the loop that reads every step before planning the next (the same graphs, so the same logits),
    with stops at different steps and a late joiner."""
    prompts = [_prompt(2, 20), _prompt(3, 63), _prompt(4, 100), _prompt(5, 45)]
    budgets = [3, 6, 1, 4]
    cfg = EngineConfig(cp=1, page_size=PAGE, pages_per_rank=64, chunk_size=256, max_requests=4, device="cuda",
                       graph_tokens=64)
    got = {p: launch(_pipelined_ranks, 1, args=(cfg, prompts, budgets, 2, p), device="cuda", timeout_s=600)[0]
           for p in (True, False)}
    assert got[True][0] == got[False][0]
    assert got[True][1] == 7 and got[False][1] == 6


def _sampled_three_ways(device: str) -> None:
    """Generations sampled inside the step (``sampling.sample_rows``: temperature, top-k, top-p, min-p; one greedy
    beside them), pipelined and read in turn, make the tokens the host picks (``sampling.pick``) from the same
    steps' logits."""
    from cpkv.engine.protocol import SamplingParams

    prompts = [_prompt(2, 20), _prompt(3, 63), _prompt(4, 100), _prompt(5, 45)]
    budgets = [5, 6, 4, 5]
    sampled = {0: SamplingParams(temperature=0.9, seed=3), 1: SamplingParams(temperature=1.2, top_p=0.9, seed=4),
               3: SamplingParams(temperature=0.7, top_k=20, min_p=0.02, seed=5)}
    extra = {"graph_tokens": 64} if device == "cuda" else {}
    cfg = EngineConfig(cp=1, page_size=PAGE, pages_per_rank=64, chunk_size=256, max_requests=4, device=device,
                       **extra)
    got = {mode: launch(_pipelined_ranks, 1, args=(cfg, prompts, budgets, 2, mode == "pipelined", sampled,
                                                   mode == "host"), device=device, timeout_s=600)[0][0]
           for mode in ("pipelined", "sync", "host")}
    assert got["pipelined"] == got["sync"] == got["host"], got
    assert any(len(set(got["host"][r][len(prompts[r]) + 1:])) > 1 for r in sampled)


def test_tokens_sampled_in_the_step_are_the_hosts_picks():
    """CPU: the graphs form's fixed-shape step run eagerly (``_sampled_three_ways``)."""
    _sampled_three_ways("cpu")


@pytest.mark.cuda
@pytest.mark.triton
def test_gpu_tokens_sampled_in_the_graph_are_the_hosts_picks():
    """CUDA, the step's graphs (``_sampled_three_ways``)."""
    _sampled_three_ways("cuda")

"""The online rank loop behind ``cpkv serve``: the model, KV pools and the CP-wide prefix cache stay resident;
requests arrive through rank 0's inbox and generate as their ``SamplingParams`` say (docs/design.md, the online
engine).

    step       rank 0 drains its inbox (waits up to IDLE_S when there is no work) and broadcasts the messages:
               every rank applies the same Submit / Cancel / Stop at the same step (one host collective)
    schedule   the same Scheduler, admission and KV-cache manager as the trace loop (``BatchExecutor``)
    run        ``BatchExecutor.run``; the rank that holds a request's last token picks the next token from its
               logits (``sampling.pick_rows``: the argmax when greedy, one batched draw on the device without
               penalties), an all-reduce (max over -1) tells every rank;
               log-probabilities, when a request asks for them, travel from that rank in one all-gather
    look ahead a batch that finishes no request (a long prompt's middle chunks) takes the next step's messages,
               forms the next batch and builds its plan while the GPU runs it (the executor's look-ahead): the
               chunks run back to back. A batch that finishes a request does not: its tokens decide the next
               decode steps. Messages that arrive after that point wait for the step after.
    decode     with ``cfg.decode`` "paged" (peer memory at cp > 1): a prompt's last chunk keeps its pages and the
               generation joins the ``Decoder``; after each batch, one paged decode step advances every running
               generation by a token over the KV where it lies (``cpkv.engine.decode``; docs/design.md §11).
               Pipelined where the runner can (the graphs form at cp 1) and every running generation's token can
               be picked in the graph (greedy, or sampled without penalties or log-probabilities:
               ``sampling.sample_rows``): step n + 1 is launched before step n's tokens are read, its inputs taken
               on the device, so the host's planning and reporting overlap the GPU; a generation that stops at
               step n's token has run one step past it (dropped). Otherwise each step is read before the next
    continue   otherwise ("extend", or a prefix the chunk could not keep) a generation's next step is a new
               scheduler request: prompt + tokens so far, queued as a decode step. Its cached prefix (page-aligned
               full pages) comes from the prefix cache, so a step recomputes the tail partial page and the new
               token -- the tokens ``cpkv run`` gives for that sequence
    report     rank 0 sends the parent one ``Step`` per loop step with news (tokens, finishes, pages used)

A finished or cancelled generation holds nothing: its full pages stay in the prefix cache (the next turn of a
conversation hits them), unheld, evictable. Decode steps run after every batch (paged) or queue before new
prompts and get a turn between the chunks of a long prompt (extend, ``Scheduler``), so a long prefill stalls
them by at most one chunk.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

import torch

from cpkv.dist import RankContext
from cpkv.engine import sampling
from cpkv.engine.config import EngineConfig
from cpkv.engine.decode import DecodeRunner
from cpkv.engine.executor import Ahead, BatchExecutor
from cpkv.engine.instruments import NoInstruments
from cpkv.engine.protocol import Cancel, Finished, Flush, Flushed, Ready, Step, Stop, Submit, Token, mix_seed
from cpkv.engine.rank import rank_model, share_cores
from cpkv.scheduler import Batch, Request
from cpkv.scheduler.decode import Decoder

IDLE_S = 0.2  # rank 0's longest wait on an empty inbox before the (empty) step's broadcast: idle ranks stay in
#               step with it, far inside the collective timeout


@dataclass
class Generation:
    """One request being served: its tokens so far (prompt + generated) and its current scheduler step."""

    sub: Submit
    tokens: list[int]
    made: int = 0
    step: Request | None = None

    @property
    def rid(self) -> int:
        return self.sub.rid


class OnlineLoop:
    """One rank's server loop: a ``BatchExecutor`` (no instruments: a server keeps no per-batch records) driven by
    messages instead of a trace."""

    def __init__(self, ctx: RankContext, cfg: EngineConfig, model) -> None:
        self.ctx, self.cfg, self.rank = ctx, cfg, ctx.rank
        self.ex = BatchExecutor(ctx, cfg, model, NoInstruments())
        self.sched, self.kv = self.ex.sched, self.ex.kv
        self.live: dict[int, Generation] = {}
        self._ahead_news: list = []  # news of the messages taken during a look-ahead, reported with that step
        self._stopping = False       # a Stop came during a look-ahead: stop once the running batch is done
        # the paged decode path: every rank's pool must be readable (peer memory; agreed by the group)
        paged = cfg.decode == "paged" and (cfg.cp == 1 or self.ex.rt.mem.available)
        self.decoder = Decoder(self.kv, cfg.cp, cfg.page_size, model.cfg.max_context) if paged else None
        self.runner = DecodeRunner(model, self.ex.rt, self.ex.ep, self.rank, self.ex.graphs) if paged else None
        self._launched: tuple[Any, Any] | None = None  # the pipelined step in flight: (DecodeStep, Launched)

    def serve(self) -> dict[str, Any]:
        """Loop until a Stop arrives; returns {"batches": n, "planned_ahead": n, "decode_steps": n (paged),
        "decode_pipelined": n (of them launched ahead of the host)}."""
        self.ctx.barrier()
        if self.rank == 0:
            self.ctx.report(Ready())
        ahead: Ahead | None = None
        while not self._stopping:
            if ahead is None:
                batch, news = self._schedule()
            else:
                batch, news = ahead.batch, []
            if batch is not None:
                step_news, ahead = self._step(batch, ahead)
                news += step_news + self._ahead_news
                self._ahead_news = []
            reported = False
            if self._decoding and not self._stopping:
                if self.rank == 0 and news:  # the batch's tokens first: a first token does not wait for the decode
                    # step's launch (which captures a graph at a new batch or context bucket: seconds at depth)
                    self.ctx.report(Step(tuple(news), tuple(self.kv.pages_used()), len(self.live)))
                    news, reported = [], True
                news += self._decode()
            if self.rank == 0 and (news or (batch is not None and not reported)):
                self.ctx.report(Step(tuple(news), tuple(self.kv.pages_used()), len(self.live)))
        self._read_launched()  # a pipelined step still in flight: its tokens are not reported (stopping)
        self.ex.drain()
        return {"batches": self.ex.batches, "planned_ahead": self.ex.planned_ahead,
                "decode_steps": self.runner.steps if self.runner is not None else 0,
                "decode_pipelined": self.runner.launched if self.runner is not None else 0}

    @property
    def _decoding(self) -> bool:
        """Generations run on the paged decode path, or its pipelined step is still to be read (the same answer
        on every rank)."""
        return self.decoder is not None and (len(self.decoder) > 0 or self._launched is not None)

    def _schedule(self) -> tuple[Batch | None, list]:
        """This step's messages applied, host-tier pages reloaded, the next batch formed -> (batch, news); a Stop
        ends the loop (no batch)."""
        msgs = self._messages()
        if any(isinstance(m, Stop) for m in msgs):
            self._stopping = True
            return None, []
        news = [ev for m in msgs for ev in self._apply(m)]
        self.ex.reload_waiting()
        batch = self.sched.next_batch()
        return batch, news + self._rejections()

    # -- messages ----------------------------------------------------------------------------------
    def _messages(self) -> list:
        """This step's messages, the same list on every rank (rank 0's inbox, broadcast)."""
        msgs: list = []
        if self.rank == 0:
            if not (self.sched.has_work or self._decoding):
                try:
                    msgs.append(self.ctx.inbox.get(timeout=IDLE_S))
                except queue.Empty:
                    pass
            while True:
                try:
                    msgs.append(self.ctx.inbox.get_nowait())
                except queue.Empty:
                    break
        return self.ctx.broadcast_object(msgs, src=0)

    def _apply(self, msg) -> list:
        if isinstance(msg, Submit):
            gen = Generation(msg, list(msg.tokens))
            self.live[gen.rid] = gen
            return self._queue(gen)
        if isinstance(msg, Cancel):
            gen = self.live.pop(msg.rid, None)
            if gen is None:
                return []
            if self.decoder is not None and msg.rid in self.decoder.seqs:
                self.decoder.finish(msg.rid)
            elif gen.step is not None:
                self.sched.cancel(gen.step)
            return [Finished(msg.rid, "cancelled")]
        if isinstance(msg, Flush):  # every rank applies it at the same step: the trees stay alike
            busy = self.live or self.sched.has_work
            return [Flushed(msg.rid, -1 if busy else self.kv.flush())]
        raise TypeError(f"unknown online engine message {msg!r}")

    def _queue(self, gen: Generation) -> list:
        """Queue the generation's next step: prompt + tokens so far (a decode step after the first token)."""
        gen.step = Request((gen.rid, gen.made), list(gen.tokens), len(gen.tokens))
        gen.step.keep = self.decoder is not None  # its last chunk keeps its pages for the paged decode path
        why = self.sched.add(gen.step, decode=gen.made > 0)
        if why is None:
            return []
        del self.live[gen.rid]
        return [Finished(gen.rid, "rejected", f"{why.reason}: {why.detail}")]

    def _rejections(self) -> list:
        """Steps the scheduler rejected at admission since the last call."""
        out = []
        for req in self.sched.rejected:
            gen = self.live.get(req.rid[0])
            if gen is not None and gen.step is req:
                del self.live[gen.rid]
                out.append(Finished(gen.rid, "rejected", req.reason))
        self.sched.rejected.clear()  # a server runs for long: nothing kept per request once reported
        return out

    # -- batches -----------------------------------------------------------------------------------
    def _step(self, batch: Batch, ahead=None) -> tuple[list, Any]:
        """Run the batch (``ahead``: with its plan built during the batch before); each finished step's token
        (agreed by every rank) extends its generation -> (news, the next batch built ahead or None)."""
        res = self.ex.run(batch, ahead, then=self._next_ahead if self._may_look_ahead(batch) else None)
        tokens, probs = self._agree([(r.rid, self.live[r.rid[0]]) for r in res.finished], res.logits)
        out: list = []
        for req, tok in zip(res.finished, tokens):
            gen = self.live[req.rid[0]]
            news, done = self._take(gen, tok, probs.get(req.rid), req.cached)
            out += news + self._carry(gen, req, done)
        return out, res.ahead

    def _decode(self) -> list:
        """One paged decode step of every running generation -> news (tokens, finishes, generations that found
        no page for their next token)."""
        if self.runner.pipelined and all(sampling.device_ok(g.sub.sampling) for g in self.live.values()):
            return self._decode_pipelined()
        out = self._read_launched()
        step, failed = self.decoder.plan()
        for rid, reason in failed:
            del self.live[rid]
            out.append(Finished(rid, "rejected", reason))
        if step is None:
            return out
        logits = self.runner.run(step)
        tokens, probs = self._agree([(e.rid, self.live[e.rid]) for e in step.entries], logits)
        for e, tok in zip(step.entries, tokens):
            self.decoder.advance(e.rid)  # the token's KV rows are in its page
            news, done = self._take(self.live[e.rid], tok, probs.get(e.rid))
            out += news
            if done:
                self.decoder.finish(e.rid)
        return out

    def _decode_pipelined(self) -> list:
        """Launch the next step, then read the step before it (module docstring: decode; cp 1, every generation
        picked in the graph) -> news."""
        step, failed = self.decoder.plan()
        got = self.runner.launch(step, self._draws(step)) if step is not None else None
        out = self._read_launched()
        for rid, reason in failed:  # its token from the step before is reported first
            if self.live.pop(rid, None) is not None:
                out.append(Finished(rid, "rejected", reason))
        if step is not None:
            for e in step.entries:
                if e.rid in self.decoder.seqs:  # not stopped by the step before's token
                    self.decoder.advance(e.rid)
            self._launched = (step, got)
        return out

    def _draws(self, step) -> dict | None:
        """The launched step's sampling rows ({rid: ``decode.draw_rows``' entry}), None when every entry is greedy
        (the argmax graph). A row's key is ``mix_seed(seed, index)``, the index of the token it picks: the
        generation's tokens made so far, one more when the step in flight (unread) carries it too: the key
        ``sampling.pick`` would use on the host."""
        live = [self.live[e.rid].sub.sampling for e in step.entries]
        if all(p.greedy for p in live):
            return None
        ahead = set(self._launched[1].rids) if self._launched is not None else set()
        out = {}
        for e, p in zip(step.entries, live):
            index = self.live[e.rid].made + (e.rid in ahead)
            out[e.rid] = (p.top_k, mix_seed(p.seed, index), p.temperature, p.top_p, p.min_p)
        return out

    def _read_launched(self) -> list:
        """The pipelined step in flight, read: its tokens extend their generations (those still running) -> news."""
        if self._launched is None:
            return []
        step, got = self._launched
        self._launched = None
        # read even when no entry is live any more: the runner holds at most two unread steps (their host buffers)
        tokens = got.tokens()
        out: list = []
        for e in step.entries:
            gen = self.live.get(e.rid)
            if gen is None:
                continue  # stopped or cancelled since its launch: the step ran past its end
            news, done = self._take(gen, tokens[e.rid])
            out += news
            if done and e.rid in self.decoder.seqs:
                self.decoder.finish(e.rid)
        return out

    def _agree(self, steps: list[tuple[Any, Generation]], logits: dict) -> tuple[list[int], dict]:
        """Each step's next token, picked by the rank holding its logits, agreed by every rank (an all-reduce, max
        over -1), and the log-probabilities asked for -> (tokens, {step key: (log p, top)})."""
        held = [(k, gen) for k, gen in steps if k in logits]
        picked = dict(zip((k for k, _ in held), sampling.pick_rows(
            [logits[k] for k, _ in held], [g.sub.sampling for _, g in held], [g.tokens for _, g in held],
            [len(g.sub.tokens) for _, g in held], [g.made for _, g in held]))) if held else {}
        tokens = self.ctx.all_reduce_max_list([picked.get(k, -1) for k, _ in steps])
        return tokens, self._logprobs(steps, logits, tokens)

    def _logprobs(self, steps: list[tuple[Any, Generation]], logits: dict, tokens: list[int]) -> dict:
        """{step key: (log p(token), top)} for the steps whose generation asks for log-probabilities, from the rank
        holding each one's logits (one all-gather; none when no request asks: the same on every rank)."""
        want = {k: gen.sub.sampling.logprobs for k, gen in steps}
        if all(n is None for n in want.values()):
            return {}
        mine = {k: sampling.logprobs(logits[k], tok, want[k]) for (k, _), tok in zip(steps, tokens)
                if k in logits and want[k] is not None}
        return {k: v for part in self.ctx.all_gather_object(mine) for k, v in part.items()}

    def _may_look_ahead(self, batch: Batch) -> bool:
        """Look ahead after a batch that finishes no request (same decision on every rank: replicated state)."""
        return self.cfg.look_ahead and self.ex.host is None and not any(e.last_chunk for e in batch.entries)

    def _next_ahead(self) -> Batch | None:
        """During look-ahead: this step's messages first (every rank the same list), then the next batch; None
        after a Stop (the loop ends once the running batch is reported)."""
        msgs = self._messages()
        if any(isinstance(m, Stop) for m in msgs):
            self._stopping = True
            return None
        self._ahead_news += [ev for m in msgs for ev in self._apply(m)]
        batch = self.sched.next_batch()
        self._ahead_news += self._rejections()
        return batch

    def _take(self, gen: Generation, tok: int, probs: tuple | None = None, cached: int = -1) -> tuple[list, bool]:
        """``tok`` extends ``gen`` -> (news, done: it stopped and left ``live``). ``cached``: the prefix its prompt
        found cached (reported with the first token)."""
        assert tok >= 0, f"no rank held the last token of generation {gen.rid!r}"
        lp, top = probs if probs is not None else (None, ())
        first = gen.made == 0
        out: list = [Token(gen.rid, tok, gen.made, cached if first else -1, lp, top,
                           len(gen.sub.tokens) if first else 0)]
        gen.tokens.append(tok)
        gen.made += 1
        if tok in gen.sub.stop_ids or gen.made >= gen.sub.max_new_tokens:
            del self.live[gen.rid]
            return out + [Finished(gen.rid, "stop" if tok in gen.sub.stop_ids else "length")], True
        return out, False

    def _carry(self, gen: Generation, req: Request, done: bool) -> list:
        """After a batch finished ``gen``'s step ``req``: a chunk that kept its pages hands them to the decoder (or
        lets them go when ``gen`` is done); otherwise a running generation's next step is queued (extend)."""
        if req.keep:
            if done:
                self.decoder.discard(req.prefix, req.tail)
            else:
                self.decoder.start(gen.rid, gen.tokens, req.prefix, req.tail)
            return []
        return [] if done else self._queue(gen)


def online_main(ctx: RankContext, cfg: EngineConfig) -> dict[str, Any]:
    """Rank entry point of ``cpkv serve`` (``cpkv.dist.RankGroup``): load the model, serve until Stop."""
    share_cores(ctx)
    loop = OnlineLoop(ctx, cfg, rank_model(ctx, cfg))
    try:
        return loop.serve()
    finally:
        loop.ex.close()

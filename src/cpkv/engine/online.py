"""The online rank loop behind ``cpkv serve``: the model, KV pools and the CP-wide prefix cache stay resident;
requests arrive through rank 0's inbox and generate as their ``SamplingParams`` say (docs/design.md, the online
engine).

    step       rank 0 drains its inbox (waits up to IDLE_S when there is no work) and broadcasts the messages:
               every rank applies the same Submit / Cancel / Stop at the same step (one host collective)
    schedule   the same Scheduler, admission and KV-cache manager as the trace loop (``BatchExecutor``)
    run        ``BatchExecutor.run``; the rank that holds a request's last token picks the next token from its
               logits (``sampling.pick``: the argmax when greedy), an all-reduce (max over -1) tells every rank;
               log-probabilities, when a request asks for them, travel from that rank in one all-gather
    look ahead a batch that finishes no request (a long prompt's middle chunks) takes the next step's messages,
               forms the next batch and builds its plan while the GPU runs it (the executor's look-ahead): the
               chunks run back to back. A batch that finishes a request does not: its tokens decide the next
               decode steps. Messages that arrive after that point wait for the step after.
    continue   a generation's next step is a new scheduler request: prompt + tokens so far, queued as a decode
               step. Its cached prefix (page-aligned full pages) comes from the prefix cache, so a step recomputes
               the tail partial page and the new token -- the tokens ``cpkv run`` gives for that sequence
    report     rank 0 sends the parent one ``Step`` per loop step with news (tokens, finishes, pages used)

A finished or cancelled generation holds nothing: its full pages stay in the prefix cache (the next turn of a
conversation hits them), unheld, evictable. Decode steps queue before new prompts and get a turn between
the chunks of a long prompt (``Scheduler``), so a long prefill stalls them by at most one chunk.
"""
from __future__ import annotations

import queue
from dataclasses import dataclass
from typing import Any

import torch

from cpkv.dist import RankContext
from cpkv.engine import sampling
from cpkv.engine.config import EngineConfig
from cpkv.engine.executor import Ahead, BatchExecutor
from cpkv.engine.instruments import NoInstruments
from cpkv.engine.protocol import Cancel, Finished, Flush, Flushed, Ready, Step, Stop, Submit, Token
from cpkv.engine.rank import rank_model, share_cores
from cpkv.scheduler import Batch, Request

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

    def serve(self) -> dict[str, Any]:
        """Loop until a Stop arrives; returns {"batches": n, "planned_ahead": n}."""
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
            if self.rank == 0 and (news or batch is not None):
                self.ctx.report(Step(tuple(news), tuple(self.kv.pages_used()), len(self.live)))
        self.ex.drain()
        return {"batches": self.ex.batches, "planned_ahead": self.ex.planned_ahead}

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
            if not self.sched.has_work:
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
            if gen.step is not None:
                self.sched.cancel(gen.step)
            return [Finished(msg.rid, "cancelled")]
        if isinstance(msg, Flush):  # every rank applies it at the same step: the trees stay alike
            busy = self.live or self.sched.has_work
            return [Flushed(msg.rid, -1 if busy else self.kv.flush())]
        raise TypeError(f"unknown online engine message {msg!r}")

    def _queue(self, gen: Generation) -> list:
        """Queue the generation's next step: prompt + tokens so far (a decode step after the first token)."""
        gen.step = Request((gen.rid, gen.made), list(gen.tokens), len(gen.tokens))
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
        finished, logits = res.finished, res.logits
        mine = [self._pick(logits[r.rid], self.live[r.rid[0]]) if r.rid in logits else -1 for r in finished]
        tokens = self.ctx.all_reduce_max_list(mine)
        probs = self._logprobs(finished, logits, tokens)
        out: list = []
        for req, tok in zip(finished, tokens):
            out += self._advance(self.live[req.rid[0]], req, tok, probs.get(req.rid))
        return out, res.ahead

    def _pick(self, row: torch.Tensor, gen: Generation) -> int:
        return sampling.pick(row, gen.sub.sampling, gen.tokens, len(gen.sub.tokens), gen.made)

    def _logprobs(self, finished: list[Request], logits: dict, tokens: list[int]) -> dict:
        """{step id: (log p(token), top)} for the finished steps whose generation asks for log-probabilities, from
        the rank holding each one's logits (one all-gather; none when no request asks: the same on every rank)."""
        want = {r.rid: self.live[r.rid[0]].sub.sampling.logprobs for r in finished}
        if all(n is None for n in want.values()):
            return {}
        mine = {r.rid: sampling.logprobs(logits[r.rid], tok, want[r.rid]) for r, tok in zip(finished, tokens)
                if r.rid in logits and want[r.rid] is not None}
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

    def _advance(self, gen: Generation, req: Request, tok: int, probs: tuple | None = None) -> list:
        assert tok >= 0, f"no rank held the last token of step {req.rid!r}"
        lp, top = probs if probs is not None else (None, ())
        first = gen.made == 0
        out: list = [Token(gen.rid, tok, gen.made, req.cached if first else -1, lp, top,
                           len(gen.sub.tokens) if first else 0)]
        gen.tokens.append(tok)
        gen.made += 1
        if tok in gen.sub.stop_ids or gen.made >= gen.sub.max_new_tokens:
            del self.live[gen.rid]
            return out + [Finished(gen.rid, "stop" if tok in gen.sub.stop_ids else "length")]
        return out + self._queue(gen)


def online_main(ctx: RankContext, cfg: EngineConfig) -> dict[str, Any]:
    """Rank entry point of ``cpkv serve`` (``cpkv.dist.RankGroup``): load the model, serve until Stop."""
    share_cores(ctx)
    loop = OnlineLoop(ctx, cfg, rank_model(ctx, cfg))
    try:
        return loop.serve()
    finally:
        loop.ex.close()

"""The waiting queue and the batch loop the engine (and the replay) drive. No torch import.

    sched = Scheduler(kv, caps, model=model, cp=cp_config, staging_pages=staging.pages)   # kv: KVCacheManager
    sched.add(Request(rid, tokens, len(tokens)))
    while sched.has_work:
        batch = sched.next_batch()          # entries: (request, prefix_len, extend_len, pages, ...)
        ...run the forward, writing each entry's KV into entry.pages...
        done = sched.postprocess(batch)          # commits full pages to the KV cache, releases the rest, requeues
                                            #   (a ``keep`` request's last chunk keeps them: cpkv.scheduler.decode)

One batch is in flight at a time. Order: the request whose earlier chunks ran goes first, then the decode
steps of running generations (``add(req, decode=True)``, the online engine), then the waiting queue in
arrival order (FIFO, no overtaking: the first request that does not fit closes the batch). Decode steps and
prompts take turns: a batch led by decode steps that left a prompt waiting is followed by one led by the
waiting queue, and while decode steps wait, a chunked prompt yields every other batch to them, so running
generations never starve a new prompt and a long prefill delays a decode by at most one chunk. A request
that cannot run even alone in an empty batch is rejected with its reason, so it never blocks the queue;
``cancel`` takes a request out between batches and drops what it holds. Every decision depends only on the
calls made, so every rank takes the same ones.
"""
from __future__ import annotations

from collections import deque
from cpkv.config import AdmissionCaps, CPConfig, ModelConfig
from cpkv.errors import AdmissionError
from cpkv.kvcache.manager import EMPTY, KVCacheManager
from cpkv.scheduler.admission import Admission, Admitted, PrefillAdder, Rejected
from cpkv.scheduler.batch import Batch, Entry
from cpkv.scheduler.request import Request, Status


class Scheduler:
    """Admission over the CP-wide KV cache, reached only through the KVCacheManager's verbs.

    ``kv``: one pool per rank (shared KV) or a single one (``replicated``: every page on every rank).
    ``key_unit``: tokens per element of ``Request.keys`` (1: token ids; the page size: page ids, with
    ``kv.page_size == 1``). ``staging_pages``: the compose runtime's, checked against the caps.
    """

    def __init__(self, kv: KVCacheManager, caps: AdmissionCaps, *, model: ModelConfig, cp: CPConfig,
                 policy: str = "solo", staging_pages: int | None = None, key_unit: int = 1,
                 replicated: bool = False, full_hit: str = "page", logits_budget: int | None = None) -> None:
        self.adm = Admission.build(caps, model, cp, policy=policy, staging_pages=staging_pages,
                                   logits_budget=logits_budget, replicated=replicated, full_hit=full_hit)
        _check_cache(kv, cp, key_unit, replicated)
        self.kv = kv
        self.key_unit = key_unit
        self.waiting: deque[Request] = deque()
        self.decoding: deque[Request] = deque()   # decode steps of running generations: before new prompts
        self.resuming: deque[Request] = deque()   # chunked requests whose next chunk goes first
        self.rejected: list[Request] = []
        self.in_flight: Batch | None = None
        self.num_batches = 0
        self._yielded = False  # the last batch was decode steps run while a chunked request waited
        self._prompt_turn = False  # the last batch was led by decode steps and left a prompt waiting

    @property
    def page_size(self) -> int:
        return self.adm.page_size

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.decoding or self.resuming) or self.in_flight is not None

    @property
    def _resume(self) -> Request | None:
        """The chunked request whose next chunk goes first (None: none)."""
        return self.resuming[0] if self.resuming else None

    @property
    def queued(self) -> list[Request]:
        """Requests not yet started, in the order admission tries them."""
        return [*self.decoding, *self.waiting]

    # -- queue -------------------------------------------------------------------------------------
    def add(self, req: Request, decode: bool = False) -> Rejected | None:
        """Queue a request; a request that can never run is rejected at once (returned). ``decode``: the
        next step of a running generation (queued before new prompts)."""
        _check_request(req, self.key_unit)
        never = self.adm.never_reason(req.prompt_len, self.pool_pages)
        if never is not None:
            self._reject(req, never)
            return never
        req.status = Status.WAITING
        (self.decoding if decode else self.waiting).append(req)
        return None

    def cancel(self, req: Request) -> bool:
        """Take ``req`` out of the queues between batches, dropping the prefix it holds (its pages stay
        cached, unheld). False when it is not queued (finished, rejected, or never added)."""
        if self.in_flight is not None:
            raise AdmissionError(f"cancel(): batch {self.in_flight.index} is in flight: finish() it first")
        for queue in (self.waiting, self.decoding, self.resuming):
            if any(r is req for r in queue):
                queue.remove(req)
                self.kv.drop(req.prefix)
                req.prefix, req.status, req.reason = EMPTY, Status.CANCELLED, "cancelled"
                return True
        return False

    @property
    def pool_pages(self) -> int:
        return self.kv.pool_pages

    def _reject(self, req: Request, why: Rejected) -> None:
        self.kv.drop(req.prefix)
        req.prefix = EMPTY
        req.status, req.reason = Status.REJECTED, f"{why.reason}: {why.detail}"
        self.rejected.append(req)

    # -- batches -----------------------------------------------------------------------------------
    def next_batch(self) -> Batch | None:
        """The next batch (its pages allocated, its prefix locked), or None when nothing can run."""
        if self.in_flight is not None:
            raise AdmissionError(f"batch {self.in_flight.index} is still in flight: finish() it first")
        if self.resuming and self.decoding and not self._yielded:  # decode steps' turn between two chunks
            adder = PrefillAdder(self.adm, self.kv)
            self._fill(adder, self.decoding, reject_alone=False)
            if adder.entries:
                self._yielded = True
                return self._launch(adder.entries)
        self._yielded = False
        adder = PrefillAdder(self.adm, self.kv)
        if self.resuming:
            req = self.resuming.popleft()
            res = adder.try_add(req)
            if not isinstance(res, Admitted):
                self._reject(req, res)  # alone in an empty batch: it can never go on
        lead, follow = (self.waiting, self.decoding) if self._prompt_turn else (self.decoding, self.waiting)
        decodes = len(self.decoding)
        if self._fill(adder, lead):
            self._fill(adder, follow)
        self._prompt_turn = not self._prompt_turn and len(self.decoding) < decodes and bool(self.waiting)
        if not adder.entries:
            return None
        return self._launch(adder.entries)

    def _fill(self, adder: PrefillAdder, queue: deque[Request], reject_alone: bool = True) -> bool:
        """Admit the head of ``queue`` while it fits; True when the queue ran empty. A head that can never
        fit (or, with ``reject_alone``, not even alone in an empty batch) is rejected."""
        while queue:
            res = adder.try_add(queue[0])
            if isinstance(res, Admitted):
                queue.popleft()
            elif res.permanent or (reject_alone and not adder.entries):
                self._reject(queue.popleft(), res)
            else:
                return False
        return True

    def _launch(self, entries: list[Entry]) -> Batch:
        batch = Batch(self.num_batches, tuple(entries), self.adm.page_size, self.adm.cp, self.adm.strategy)
        self.num_batches += 1
        self.in_flight = batch
        return batch

    def postprocess(self, batch: Batch) -> list[Request]:
        """The batch's KV is written: cache its full pages, free the rest, requeue unfinished requests.

        Returns the requests whose last chunk this was.
        """
        if batch is not self.in_flight:
            raise AdmissionError(f"finish(): batch {batch.index} is not the batch in flight")
        done = [e.request for e in batch.entries if self._finish_entry(e)]
        self.in_flight = None
        return done

    def _finish_entry(self, e: Entry) -> bool:
        req, P = e.request, self.adm.page_size
        end = e.seq_len
        keep = (end // P - e.prefix_len // P) if e.prefix_len % P == 0 else 0
        stays = e.last_chunk and req.keep and e.prefix_len % P == 0  # a generation decoding on keeps its pages
        held = self.kv.commit(self._keys(req, end // P * P), req.prefix, e.pages[:keep],
                              hold=not e.last_chunk or stays)
        if stays:
            req.tail = tuple(e.pages[keep:])
        else:
            req.keep = req.keep and not e.last_chunk  # an unaligned prefix (full_hit token) keeps nothing
            self.kv.release(e.pages[keep:])
        req.chunks += 1
        req.prefix = held
        if e.last_chunk:
            req.done, req.status = req.prompt_len, Status.FINISHED
            return True
        req.done = end
        self.resuming.append(req)
        return False

    def _keys(self, req: Request, tokens: int):
        return req.keys[: tokens // self.key_unit]


def _check_cache(kv: KVCacheManager, cp: CPConfig, key_unit: int, replicated: bool) -> None:
    if key_unit < 1 or cp.page_size % key_unit or kv.page_size * key_unit != cp.page_size:
        raise AdmissionError(f"prefix cache page size {kv.page_size} x key unit {key_unit} must equal the "
                             f"page size {cp.page_size}")
    want = 1 if replicated else cp.cp
    if kv.num_pools != want:
        kind = "replicated KV: one pool standing for every rank's copy" if replicated else f"one per rank of cp={cp.cp}"
        raise AdmissionError(f"expected {want} allocators ({kind}), got {kv.num_pools}")


def _check_request(req: Request, key_unit: int) -> None:
    if not isinstance(req.prompt_len, int) or req.prompt_len < 1:
        raise AdmissionError(f"request {req.rid!r}: prompt_len must be an integer >= 1, got {req.prompt_len!r}")
    if len(req.keys) != req.prompt_len // key_unit:
        raise AdmissionError(f"request {req.rid!r}: expected {req.prompt_len // key_unit} keys "
                             f"({req.prompt_len} tokens / key unit {key_unit}), got {len(req.keys)}")
    if req.status is not Status.WAITING or req.started:
        raise AdmissionError(f"request {req.rid!r} was already scheduled ({req.status.value})")

"""Which requests share a CP prefill batch (docs/design.md §7). No torch import.

``Admission`` holds the static rules (caps, policy, byte sizes); ``PrefillAdder`` builds one batch:
``try_add(request)`` answers ``Admitted(entry)`` or ``Rejected(reason)``, ``reason`` naming the cap:

- ``chunk_size``: new tokens of the batch > the chunk size;
- ``cached_tokens``: carried prefix tokens of the batch > the cached cap;
- ``buffer_bytes``: dense buffers (both kinds, two parity halves) + staging + indexer logits
  (rows on the busiest rank × the batch's keys × 4 B, within the logits chunk budget) > the buffer cap;
- ``max_requests``; ``pages``: a writer rank has too few free pages even after LRU eviction;
- ``solo``: the policy keeps the batch or the request alone;
- ``max_context`` / ``pool_pages``: the prompt is longer than the model's context, or has more pages
  than all pools together hold: permanent, the request can never run.

Policies. ``solo`` (default): a batch holding a chunked request admits nothing else, and a request
whose carried prefix is not page-aligned runs alone. ``mix`` (experimental): after a *tail* chunk
(the last chunk of a chunked request) followers may join within the caps; a full chunk fills the
chunk and so stays alone; an unaligned prefix stays alone.

Chunks: a prompt whose remaining tokens exceed the chunk runs in chunks of exactly the chunk
(a multiple of the page size) from its page-aligned cached prefix, so every boundary is page-aligned.
Each chunk's budget is seeded with its true carried prefix (cache hit + earlier chunks).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache

from cpkv import envs
from cpkv.config import AdmissionCaps, CPConfig, ModelConfig
from cpkv.errors import AdmissionError
from cpkv.kvcache.manager import KVCacheManager, Prefix
from cpkv.layout import cdiv, split_writers
from cpkv.scheduler.batch import Entry
from cpkv.scheduler.request import Request, Status

POLICIES = ("solo", "mix")
FULL_HIT = ("page", "token")
REASONS = ("chunk_size", "cached_tokens", "buffer_bytes", "max_requests", "pages", "solo", "max_context",
           "pool_pages", "logits_budget")


@dataclass(frozen=True)
class Admitted:
    entry: Entry


@dataclass(frozen=True)
class Rejected:
    """``reason``: one of REASONS. ``permanent``: the request can never run (the scheduler drops it)."""

    reason: str
    detail: str = ""
    permanent: bool = False

    def __bool__(self) -> bool:  # so that ``if adder.try_add(r):`` reads naturally
        return False


@dataclass(frozen=True)
class Admission:
    """Static admission rules every rank applies identically.

    ``row_bytes``: token + index row bytes per token of one layer's dense buffers and staging (788 B for
    GLM-5: a batch composes index rows on its full indexer layers, so both kinds' buffers exist; what
    differs per layer kind is the pool, ``ModelConfig.kv_bytes_per_token``). ``staging_pages``: current pages
    per staging parity half (the staging identity). ``logits_budget``: bytes of one indexer logits chunk.
    ``full_hit``: a prompt entirely in the cache recomputes its last page (``page``, stays aligned) or
    only its last token (``token``: an unaligned prefix, runs alone).
    """

    caps: AdmissionCaps
    page_size: int
    cp: int
    strategy: str
    row_bytes: int
    logits_budget: int
    max_context: int
    policy: str = "solo"
    replicated: bool = False
    full_hit: str = "page"

    @classmethod
    def build(cls, caps: AdmissionCaps, model: ModelConfig, cp: CPConfig, *, policy: str = "solo",
              staging_pages: int | None = None, logits_budget: int | None = None, replicated: bool = False,
              full_hit: str = "page") -> "Admission":
        """Check the configuration; ``staging_pages`` (the compose runtime's) must satisfy the identity."""
        if policy not in POLICIES:
            raise AdmissionError(f"unknown admission policy {policy!r}; expected one of {', '.join(POLICIES)}")
        if full_hit not in FULL_HIT:
            raise AdmissionError(f"unknown full_hit {full_hit!r}; expected one of {', '.join(FULL_HIT)}")
        check_staging_identity(caps, cp.page_size, staging_pages)
        if logits_budget is None:
            logits_budget = int(envs.get("CPKV_MQA_LOGITS_CHUNK_MAX_GB") * (1 << 30))
        if logits_budget < 4:
            raise AdmissionError(f"logits budget must be >= 4 bytes, got {logits_budget}")
        return cls(caps, cp.page_size, cp.cp, cp.strategy, model.row_bytes("token") + model.row_bytes("index"),
                   logits_budget, model.max_context, policy, replicated, full_hit)

    @property
    def chunk_tokens(self) -> int:
        """The new tokens one batch may compute (``AdmissionCaps.chunk_tokens``)."""
        return self.caps.chunk_tokens(self.page_size)

    @property
    def staging_pages(self) -> int:
        return self.caps.staging_pages(self.page_size)

    @property
    def staging_bytes(self) -> int:
        """Two parity halves of staging pages, row 0 of each reserved."""
        return 2 * (self.staging_pages + 1) * self.page_size * self.row_bytes

    def buffer_bytes(self, slots: int, rows: int) -> int:
        """Per-rank bytes of a batch of ``slots`` logical pages whose busiest rank has ``rows`` queries:
        its dense buffers, the staging and one indexer logits chunk (the memory plan, ``cpkv.memplan``,
        counts the same parts)."""
        return self.dense_bytes(slots) + self.staging_bytes + self.logits_bytes(slots * self.page_size, rows)

    def dense_bytes(self, slots: int) -> int:
        """Dense buffers of ``slots`` pages: 2 parity halves × keys × row_bytes (both kinds)."""
        return 2 * slots * self.page_size * self.row_bytes

    def logits_bytes(self, keys: int, rows: int) -> int:
        """One indexer logits chunk over ``keys`` keys: the rows that fit the logits budget (at most ``rows``)
        × keys × 4 B. A key row that alone exceeds the budget: no fit (1 << 62)."""
        per_row = 4 * keys
        if per_row > self.logits_budget:
            return 1 << 62
        return min(rows, self.logits_budget // per_row) * per_row

    def last_prefix(self, prompt_len: int, cached: int) -> int:
        """Carried prefix of the last chunk when the first chunk starts at ``cached``."""
        cap = self.chunk_tokens
        rest = prompt_len - cached
        return cached if rest <= cap else cached + (rest - 1) // cap * cap

    def chunk_rows(self, extend: int, rot: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(writer of each new page, query rows per rank) of a chunk of ``extend`` tokens at rotation ``rot``."""
        return self._chunk_rows(extend, rot % (2 * self.cp))  # the split depends on rot modulo the runs

    @lru_cache(maxsize=1 << 14)
    def _chunk_rows(self, extend: int, rot: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        P = self.page_size
        writers = split_writers(cdiv(extend, P), self.cp, self.strategy, rot)
        rows = [0] * self.cp
        for w in writers:
            rows[w] += P
        if extend % P:
            rows[writers[-1]] -= P - extend % P
        return tuple(writers), tuple(rows)

    @lru_cache(maxsize=8192)
    def never_reason(self, prompt_len: int, pool_pages: int) -> Rejected | None:
        """Why a prompt can never run (with no cache hit), or None."""
        P, caps = self.page_size, self.caps
        if prompt_len > self.max_context:
            return Rejected("max_context", f"{prompt_len} tokens exceed the model's context of {self.max_context}",
                            True)
        if cdiv(prompt_len, P) > pool_pages:
            return Rejected("pool_pages", f"{cdiv(prompt_len, P)} pages exceed the {pool_pages} pages of all pools",
                            True)
        if self.last_prefix(prompt_len, 0) > caps.cached_tokens:
            return Rejected("cached_tokens", f"its last chunk carries {self.last_prefix(prompt_len, 0)} prefix "
                            f"tokens, above the cached cap of {caps.cached_tokens}", True)
        last = self.last_prefix(prompt_len, 0)
        for start in sorted({max(0, last - self.chunk_tokens), last}):  # bytes grow with keys and rows
            extend = min(self.chunk_tokens, prompt_len - start)
            keys = cdiv(start + extend, P) * P
            if 4 * keys > self.logits_budget:  # one query's logits row alone: the budget is too small, not the chunk
                return Rejected("logits_budget", f"its chunk at {start} sees {keys} keys: one indexer logits row "
                                f"({4 * keys} B) exceeds the logits chunk budget of {self.logits_budget} B "
                                f"(CPKV_MQA_LOGITS_CHUNK_MAX_GB)", True)
            need = self.buffer_bytes(cdiv(start + extend, P), max(self.chunk_rows(extend, 0)[1]))
            if need > caps.buffer_bytes:
                return Rejected("buffer_bytes", f"its chunk at {start} needs {need} buffer bytes alone, above the "
                                f"cap of {caps.buffer_bytes}", True)
        return None


def check_staging_identity(caps: AdmissionCaps, page_size: int, staging_pages: int | None) -> None:
    """The chunk in pages + one slack page per request must equal the compose runtime's staging pages."""
    if staging_pages is None:
        return
    want = caps.staging_pages(page_size)
    if staging_pages != want:
        raise AdmissionError(
            f"staging identity broken: chunk size {caps.chunk_tokens(page_size)} tokens / page size {page_size}"
            f" + {caps.max_requests} slack pages (one per request) = {want} pages, but the staging holds "
            f"{staging_pages}")


@dataclass
class _Plan:
    prefix: int
    extend: int
    chunked: bool
    last: bool
    cached: Prefix
    fresh: bool  # first chunk: the cached prefix still needs holding


@dataclass
class PrefillAdder:
    """One batch under construction. Budgets start at zero and grow with each admitted entry."""

    adm: Admission
    kv: KVCacheManager
    entries: list[Entry] = field(default_factory=list)
    extend: int = 0
    cached: int = 0
    slots: int = 0
    rot: int = 0
    closed: bool = False

    def __post_init__(self) -> None:
        self.rows = [0] * self.adm.cp

    @property
    def pool_pages(self) -> int:
        return self.kv.pool_pages

    def try_add(self, req: Request) -> Admitted | Rejected:
        """Admit one chunk of ``req`` (locking its prefix, allocating its pages) or say which cap stops it."""
        done = (Status.FINISHED, Status.REJECTED, Status.CANCELLED)
        if req.status in done or any(e.request is req for e in self.entries):
            raise AdmissionError(f"request {req.rid!r} cannot be added: {req.status.value} or already in this batch")
        never = self.adm.never_reason(req.prompt_len, self.pool_pages)
        if never is not None:
            return never
        caps = self.adm.caps
        if self.closed:
            return Rejected("solo", "the batch holds an entry that runs alone")
        if len(self.entries) >= caps.max_requests:
            return Rejected("max_requests", f"the batch already holds {caps.max_requests} requests")
        plan = self._plan(req)
        writers, rows = self.adm.chunk_rows(plan.extend, self.rot)
        why = self._check_caps(plan, rows)
        if why is not None:
            return why
        return self._admit(req, plan, writers, rows)

    # -- planning ----------------------------------------------------------------------------------
    def _plan(self, req: Request) -> _Plan:
        if req.started:
            return self._chunk_plan(req.prompt_len, req.done, req.prefix, True, fresh=False)
        hit = self.kv.match(req.keys)  # its device part: the engine reloads host-tier pages before admission
        return self._chunk_plan(req.prompt_len, len(hit) * self.adm.page_size, hit, False, fresh=True)

    def _chunk_plan(self, prompt: int, prefix: int, hit: Prefix, resumed: bool, fresh: bool) -> _Plan:
        adm, P = self.adm, self.adm.page_size
        if not resumed:
            if prefix >= prompt and adm.full_hit == "token" and prompt - 1 <= adm.caps.cached_tokens:
                return _Plan(prompt - 1, 1, False, True, hit, fresh)
            if prefix >= prompt:
                hit, prefix = hit.head(len(hit) - 1), prefix - P
            while len(hit) and adm.last_prefix(prompt, prefix) > adm.caps.cached_tokens:
                hit, prefix = hit.head(len(hit) - 1), prefix - P
        extend = min(prompt - prefix, adm.chunk_tokens)
        chunked = resumed or prompt - prefix > adm.chunk_tokens
        return _Plan(prefix, extend, chunked, extend == prompt - prefix, hit, fresh)

    def _alone(self, plan: _Plan) -> bool:
        if plan.prefix % self.adm.page_size:
            return True
        return plan.chunked and (self.adm.policy == "solo" or not plan.last)

    # -- caps --------------------------------------------------------------------------------------
    def _check_caps(self, plan: _Plan, rows: tuple[int, ...]) -> Rejected | None:
        adm, caps = self.adm, self.adm.caps
        if self.entries and self._alone(plan):
            return Rejected("solo", "this chunk must run alone (chunked or unaligned prefix)")
        if self.extend + plan.extend > adm.chunk_tokens:
            return Rejected("chunk_size", f"{self.extend} + {plan.extend} new tokens > cap {adm.chunk_tokens}")
        if self.cached + plan.prefix > caps.cached_tokens:
            return Rejected("cached_tokens", f"{self.cached} + {plan.prefix} prefix tokens > cap {caps.cached_tokens}")
        need = self._buffer_with(plan, rows)
        if need > caps.buffer_bytes:
            return Rejected("buffer_bytes", f"the batch would need {need} buffer bytes > cap {caps.buffer_bytes}")
        return None

    def _buffer_with(self, plan: _Plan, rows: tuple[int, ...]) -> int:
        P = self.adm.page_size
        slots = self.slots + cdiv(plan.prefix, P) + cdiv(plan.extend, P)
        return self.adm.buffer_bytes(slots, max(a + b for a, b in zip(self.rows, rows)))

    # -- pages -------------------------------------------------------------------------------------
    def _admit(self, req: Request, plan: _Plan, writers: tuple[int, ...], rows: tuple[int, ...]) -> Admitted | Rejected:
        owners = [0 if self.adm.replicated else w for w in writers]
        if plan.fresh:
            self.kv.hold(plan.cached)
        pages = self.kv.allocate(owners)
        if pages is None:
            if plan.fresh:
                self.kv.drop(plan.cached)
            return Rejected("pages", "a writer rank has too few free pages after eviction")
        entry = Entry(req, plan.prefix, plan.extend, plan.chunked, plan.last, plan.cached, pages, writers)
        self._account(entry, rows)
        if plan.fresh:
            req.cached, req.done, req.prefix = plan.prefix, plan.prefix, plan.cached
        req.status = Status.RUNNING
        return Admitted(entry)

    def _account(self, entry: Entry, rows: tuple[int, ...]) -> None:
        P = self.adm.page_size
        self.entries.append(entry)
        self.extend += entry.extend_len
        self.cached += entry.prefix_len
        self.slots += cdiv(entry.prefix_len, P) + len(entry.pages)
        self.rot += len(entry.pages)
        self.rows = [a + b for a, b in zip(self.rows, rows)]
        self.closed = self._alone(_Plan(entry.prefix_len, entry.extend_len, entry.chunked, entry.last_chunk, entry.prefix,
                                        False))

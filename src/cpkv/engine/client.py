"""The parent's side of the online engine: rank processes started once, requests submitted and cancelled by id.

    client = EngineClient(cfg)                  # cfg: EngineConfig (validated before any rank starts)
    client.start(ready_timeout_s=600)           # ranks load the model and enter the loop (``online_main``)
    rid = client.submit(tokens, 16, on_event=f) # f(Token | Finished) on the client's watch thread
    client.cancel(rid)                          # a Finished(reason="cancelled") follows unless it finished first
    client.close(timeout_s=30)                  # Stop, then every rank ends

Knows nothing of HTTP. ``never_reason(seq_len)`` answers, before any submit, whether a sequence can ever be
admitted under ``cfg`` (the ranks' own rules). When a rank dies or fails, every pending request gets
``Finished(reason="failed")`` and ``on_exit(RankFailure)`` is called once. ``on_step(Step)`` sees every step
report after its events were delivered (pages used, generations held).
"""
from __future__ import annotations

import itertools
import threading
from typing import Any, Callable, Sequence

from cpkv.dist import RankGroup
from cpkv.engine.config import EngineConfig
from cpkv.engine.protocol import Cancel, Finished, Flush, Flushed, Ready, SamplingParams, Step, Stop, Submit, Token
from cpkv.errors import RankFailure

Event = Token | Finished | Flushed


class EngineClient:
    """Submit / cancel / close over a ``RankGroup`` running ``cpkv.engine.online.online_main``."""

    def __init__(self, cfg: EngineConfig, *, timeout_s: float = 600.0, heartbeat_s: float = 30.0,
                 on_exit: Callable[[RankFailure | None], None] | None = None,
                 on_step: Callable[[Step], None] | None = None) -> None:
        from cpkv.engine.online import online_main
        from cpkv.model.config import load_model_config
        from cpkv.scheduler.admission import Admission

        self.cfg = cfg
        self.model_cfg = load_model_config(cfg.model, cfg.num_layers, cfg.experts)
        self._adm = Admission.build(cfg.caps(), self.model_cfg, cfg.cp_config, policy=cfg.policy,
                                    full_hit=cfg.full_hit)
        self._on_exit, self._on_step = on_exit, on_step
        self._lock = threading.Lock()
        self._pending: dict[int, Callable[[Event], None]] = {}
        self._ids = itertools.count(1)
        self._ready = threading.Event()
        self.failure: RankFailure | None = None
        self.closed = False
        self.results: list = []  # each rank's serve() result once closed ({"batches", "planned_ahead"})
        self.group = RankGroup(online_main, cfg.cp, device=cfg.device, args=(cfg,), timeout_s=timeout_s,
                               heartbeat_s=heartbeat_s, on_message=self._on_message, on_exit=self._exited)

    # -- facts -------------------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.model_cfg.vocab_size

    @property
    def healthy(self) -> bool:
        return self._ready.is_set() and self.failure is None and not self.closed and self.group.running

    @property
    def pids(self) -> list[int | None]:
        return self.group.pids

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    def never_reason(self, seq_len: int) -> str | None:
        """Why a sequence of ``seq_len`` tokens can never be admitted (``reason: detail``), or None."""
        why = self._adm.never_reason(seq_len, self.cfg.cp * (self.cfg.pages_per_rank - 1))
        return None if why is None else f"{why.reason}: {why.detail}"

    # -- life --------------------------------------------------------------------------------------
    def start(self, ready_timeout_s: float = 600.0) -> None:
        """Start the ranks and wait until every one serves; RankFailure when one fails first."""
        self.group.start()
        while not self._ready.wait(0.1):
            ready_timeout_s -= 0.1
            if self.failure is not None:
                raise self.failure
            if ready_timeout_s <= 0:
                self.group.stop()
                raise RankFailure(f"the ranks did not start within the start-up limit (rank pids {self.pids})")

    def submit(self, tokens: Sequence[int], max_new_tokens: int, on_event: Callable[[Event], None],
               stop_ids: frozenset[int] = frozenset(), sampling: SamplingParams = SamplingParams()) -> int:
        """Queue a generation (greedy unless ``sampling`` says otherwise); its events go to ``on_event`` (on the
        watch thread). Returns its id."""
        with self._lock:
            rid = next(self._ids)
            if self.failure is not None or self.closed:
                why = str(self.failure) if self.failure else "the engine is closed"
                on_event(Finished(rid, "failed", why))
                return rid
            self._pending[rid] = on_event
        self.group.send(0, Submit(rid, tuple(tokens), max_new_tokens, frozenset(stop_ids), sampling))
        return rid

    def flush(self, on_event: Callable[[Event], None]) -> int:
        """Ask the ranks to empty the prefix cache; ``on_event(Flushed)`` answers (pages -1: generations were
        held), or ``Finished(failed)`` when the ranks are gone."""
        with self._lock:
            rid = next(self._ids)
            if self.failure is not None or self.closed:
                on_event(Finished(rid, "failed", str(self.failure) if self.failure else "the engine is closed"))
                return rid
            self._pending[rid] = on_event
        self.group.send(0, Flush(rid))
        return rid

    def cancel(self, rid: int) -> None:
        with self._lock:
            if rid not in self._pending or self.failure is not None:
                return
        self.group.send(0, Cancel(rid))

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop the loop and end every rank (within ``timeout_s``, else they are killed). Pending requests
        are failed first. Raises the group's RankFailure if a rank failed."""
        if self.closed:
            return
        self.closed = True
        self._fail_pending("the server is shutting down")
        if self.group.running:
            self.group.send(0, Stop())
        self.results = self.group.join(timeout_s)

    # -- the watch thread --------------------------------------------------------------------------
    def _on_message(self, rank: int, msg: Any) -> None:
        if isinstance(msg, Ready):
            self._ready.set()
        elif isinstance(msg, Step):
            for ev in msg.events:
                self._deliver(ev)
            if self._on_step is not None:
                self._on_step(msg)

    def _deliver(self, ev: Event) -> None:
        with self._lock:
            f = self._pending.pop(ev.rid, None) if isinstance(ev, (Finished, Flushed)) else self._pending.get(ev.rid)
        if f is not None:
            f(ev)

    def _exited(self, exc: RankFailure | None) -> None:
        with self._lock:
            self.failure = exc if exc is not None else self.failure
        self._fail_pending(str(exc) if exc is not None else "the ranks have stopped")
        if self._on_exit is not None:
            self._on_exit(exc)

    def _fail_pending(self, why: str) -> None:
        with self._lock:
            pending, self._pending = self._pending, {}
        for rid, f in pending.items():
            f(Finished(rid, "failed", why))

"""The server's operational log lines (Python logging, uvicorn's format with a timestamp), as SGLang prints them:

    Prefill batch. #new-seq: 2, #new-token: 960, #cached-token: 64, KV pages: 31/1022 (3.0%), #running-req: 1, #queue-req: 0
    Decode batch. #running-req: 3, KV pages: 40/1022 (3.9%), cache hit rate: 6.3%, gen throughput (token/s): 41.2, #queue-req: 0

A prefill line for each engine step that gives requests their first token (the batch that ran their prompt's last
chunk), a decode line every ``decode_interval`` steps that generate later tokens. ``StepLog.step`` runs on the
engine client's watch thread for every ``Step`` report; ``counts`` gives the front end's (running, waiting).
"""
from __future__ import annotations

import copy
import logging
import time
from typing import Any, Callable

from cpkv.engine.protocol import Step, Token

log = logging.getLogger("cpkv.serve")

LEVELS = ("critical", "error", "warning", "info", "debug")
FORMAT = "%(asctime)s %(levelprefix)s %(message)s"
ACCESS_FORMAT = '%(asctime)s %(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s'


def log_config(level: str) -> dict[str, Any]:
    """uvicorn's logging configuration with timestamps, covering the ``cpkv`` loggers too (``uvicorn.Config``'s
    ``log_config``); access lines go to stderr beside the rest."""
    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    cfg["formatters"]["default"].update(fmt=FORMAT, use_colors=False)
    cfg["formatters"]["access"].update(fmt=ACCESS_FORMAT, use_colors=False)
    cfg["handlers"]["access"]["stream"] = "ext://sys.stderr"
    cfg["loggers"]["cpkv"] = {"handlers": ["default"], "level": level.upper(), "propagate": False}
    return cfg


class StepLog:
    """Turns the engine's step reports into prefill and decode lines."""

    def __init__(self, prompt_len: Callable[[int], int], counts: Callable[[], tuple[int, int]],
                 pool_pages: int, decode_interval: int = 40) -> None:
        self.prompt_len, self.counts = prompt_len, counts
        self.pool_pages, self.decode_interval = pool_pages, decode_interval
        self.prompt = self.cached = 0          # since the start: the hit rate's terms
        self.decode_steps = self.decode_tokens = 0
        self.since = time.perf_counter()

    def step(self, step: Step) -> None:
        firsts = [ev for ev in step.events if isinstance(ev, Token) and ev.index == 0]
        later = sum(1 for ev in step.events if isinstance(ev, Token) and ev.index > 0)
        used = sum(step.pages_used)
        if firsts:
            self._prefill(firsts, used)
        if later:
            self.decode_steps += 1
            self.decode_tokens += later
            if self.decode_steps % self.decode_interval == 0:
                self._decode(used)

    def _prefill(self, firsts: list[Token], used: int) -> None:
        prompt = sum(ev.prompt or self.prompt_len(ev.rid) for ev in firsts)
        cached = sum(max(ev.cached, 0) for ev in firsts)
        self.prompt, self.cached = self.prompt + prompt, self.cached + cached
        running, waiting = self.counts()
        log.info("Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, KV pages: %s, #running-req: %d, "
                 "#queue-req: %d", len(firsts), prompt - cached, cached, self._pages(used), running, waiting)

    def _decode(self, used: int) -> None:
        now = time.perf_counter()
        rate = self.decode_tokens / max(now - self.since, 1e-9)
        self.since, self.decode_tokens = now, 0
        running, waiting = self.counts()
        hit = self.cached / self.prompt if self.prompt else 0.0
        log.info("Decode batch. #running-req: %d, KV pages: %s, cache hit rate: %.1f%%, gen throughput (token/s): "
                 "%.1f, #queue-req: %d", running, self._pages(used), 100 * hit, rate, waiting)

    def _pages(self, used: int) -> str:
        return f"{used}/{self.pool_pages} ({100 * used / max(self.pool_pages, 1):.1f}%)"

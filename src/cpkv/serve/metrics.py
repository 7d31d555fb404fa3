"""The server's Prometheus metrics, declared once (named as SGLang's ``sglang:*`` where the meaning matches).

Updated where the event happens (``cpkv.serve.frontend``): a request's first token (TTFT, prompt and cached
tokens, hit rate), each token (inter-token latency), its finish (end-to-end latency, time per output token), a
rejection, each engine step (pages).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

# seconds: a 128K-token prompt's TTFT can reach a minute under load (the seed's replay p99 was 49 s)
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0)
# seconds between two tokens of one request: a decode step, or a step that waited behind a prefill chunk
TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                 10.0, 20.0)

NAMES = ("cpkv:time_to_first_token_seconds", "cpkv:e2e_request_latency_seconds", "cpkv:prompt_tokens_total",
         "cpkv:cached_tokens_total", "cpkv:generation_tokens_total", "cpkv:num_requests_running",
         "cpkv:num_requests_waiting", "cpkv:cache_hit_rate", "cpkv:kv_pages_used", "cpkv:requests_rejected_total",
         "cpkv:requests_finished_total", "cpkv:engine_requests", "cpkv:time_per_output_token_seconds",
         "cpkv:inter_token_latency_seconds")


class Metrics:
    """One registry per server (tests may run several in one process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("cpkv:time_to_first_token_seconds", "Seconds from a request's arrival to its first "
                              "token", buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("cpkv:e2e_request_latency_seconds", "Seconds from a request's arrival to its last "
                             "token", buckets=LATENCY_BUCKETS, registry=r)
        self.tpot = Histogram("cpkv:time_per_output_token_seconds", "Seconds per token after the first, per "
                              "finished request of two tokens or more: (end - first token) / (tokens - 1)",
                              buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("cpkv:inter_token_latency_seconds", "Seconds between two consecutive tokens of a request",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.prompt_tokens = Counter("cpkv:prompt_tokens", "Prompt tokens of requests that got a first token",
                                     registry=r)
        self.cached_tokens = Counter("cpkv:cached_tokens", "Prompt tokens taken from the CP-wide prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("cpkv:generation_tokens", "Generated tokens", registry=r)
        self.running = Gauge("cpkv:num_requests_running", "Requests past their first token, still generating",
                             registry=r)
        self.waiting = Gauge("cpkv:num_requests_waiting", "Requests submitted, waiting for their first token",
                             registry=r)
        self.hit_rate = Gauge("cpkv:cache_hit_rate", "Cached / prompt tokens since the start", registry=r)
        self.pages = Gauge("cpkv:kv_pages_used", "KV pages in use on a rank's pool (prefix cache + in flight)",
                           ["rank"], registry=r)
        self.engine_live = Gauge("cpkv:engine_requests", "Generations the ranks hold (queued, running or between "
                                 "decode steps)", registry=r)
        self.rejected = Counter("cpkv:requests_rejected", "Requests refused: invalid (4xx), queue_full (429), "
                                "unavailable (503), admission (the engine could not place it)", ["reason"],
                                registry=r)
        self.finished = Counter("cpkv:requests_finished", "Requests ended, by finish reason (length, stop, "
                                "cancelled, failed)", ["reason"], registry=r)
        self._prompt = self._cached = 0  # the hit rate's terms

    def first_token(self, ttft_s: float, prompt: int, cached: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self._prompt += prompt
        self._cached += cached
        self.hit_rate.set(self._cached / self._prompt if self._prompt else 0.0)

    def step(self, step) -> None:
        """An engine step's report (``cpkv.engine.protocol.Step``)."""
        for rank, n in enumerate(step.pages_used):
            self.pages.labels(rank=str(rank)).set(n)
        self.engine_live.set(step.live)

    def text(self) -> bytes:
        return generate_latest(self.registry)

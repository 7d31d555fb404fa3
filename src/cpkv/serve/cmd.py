"""``cpkv serve``: the CP engine behind an OpenAI-compatible HTTP server (plus SGLang's /generate, Prometheus).

Rank processes start once and stay: the model, the KV pools and the CP-wide prefix cache live across requests.
The listening socket is bound before the ranks start (a taken port is one error line), and answers once every
rank serves (``listening on http://HOST:PORT`` on stderr; ``--port 0`` picks a free port and prints it).

SIGTERM / SIGINT: stop taking requests (503), give those in flight ``--shutdown-timeout`` seconds, fail the
rest, end every rank, exit 0 (a second signal stops at once). A rank that dies fails the requests in flight
(503), turns /health to 503 and ends the server with an error naming the rank (exit 2).

Exposure: only the HTTP socket listens where ``--host`` says (the ranks' own sockets are on loopback:
``cpkv.dist.launch``); ``--api-key`` (or ``CPKV_API_KEY``) guards every path but /health and /metrics, and a
non-loopback ``--host`` without a key is a warning line. Slow clients are cut off: ``--header-timeout`` for a
request's headers (the connection is closed), ``--body-timeout`` for its body (408; or, for the rest of a
body already answered, the connection is closed), ``KEEP_ALIVE_S`` idle between requests; ``--max-body-mb``
bounds a body (413).
"""
from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import ipaddress
import math
import signal
import socket
import sys
import threading
from dataclasses import replace
from pathlib import Path

from cpkv.errors import ConfigError, RankFailure

from cpkv.cli.args import MODES_EPILOG as EPILOG  # noqa: F401  (shown under --help)

HELP = "Serve the CP engine over HTTP: OpenAI-compatible completions and chat, SGLang's /generate, /metrics."
FLAGS = ("cp", "page_size", "strategy", "pages_per_rank", "host_pages", "chunk_size", "max_requests", "num_layers")
STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP")
KEEP_ALIVE_S = 5          # an idle keep-alive connection is closed after this long
BODY_BYTES_PER_TOKEN = 64  # the default --max-body-mb: room for a token as an id or as JSON-escaped text


def add_arguments(p: argparse.ArgumentParser) -> None:
    from cpkv import envs
    from cpkv.cli import args as a
    from cpkv.config import DEFAULT_PAGE_SIZE, SIZES as PRESETS, STRATEGIES, compose_mode

    SIZES = PRESETS["toy"]  # the tiny preset on a CPU, the default model's sizes (as cpkv run)
    from cpkv.engine.config import MODES
    from cpkv.serve.logs import LEVELS

    p.add_argument("--model", "--model-path", dest="model", default="tiny", help="preset name (tiny, glm5, "
                   "deepseek-v32) or checkpoint dir (its tokenizer and chat template, when present, enable text "
                   "prompts and chat; the tiny preset ships its own)")
    p.add_argument("--tokenizer", "--tokenizer-path", dest="tokenizer", metavar="DIR",
                   help="a checkpoint directory (or 'tiny') whose tokenizer replaces the model's")
    p.add_argument("--chat-template", metavar="FILE", help="a jinja chat template (a file, or the template's text) "
                   "replacing the tokenizer's")
    p.add_argument("--context-length", type=a.bounded_int(2, 1 << 30), metavar="N",
                   help="tokens a request may hold, prompt and generation together (default: the model's)")
    p.add_argument("--cp", type=a.ranks, default=SIZES.cp, help=f"rank processes (default {SIZES.cp})")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=a.bounded_int(0, 65535), default=30000, help="port (default 30000; 0: a free one, printed)")
    p.add_argument("--served-model-name", help="the model name clients give and answers carry (default: the "
                   "preset's name, or the checkpoint directory's base name)")
    p.add_argument("--api-key", default=envs.get("CPKV_API_KEY"), type=_api_key, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' on every path but /health and /metrics (default "
                        "CPKV_API_KEY; prefer it: a command line is visible to every user of the machine)")
    p.add_argument("--max-body-mb", type=a.bounded_float(0.0, 4096.0), default=None, metavar="MB",
                   help=f"largest request body in MiB, 413 beyond it (default: {BODY_BYTES_PER_TOKEN} bytes per "
                        "token of the model's context, at least 1)")
    p.add_argument("--header-timeout", type=a.timeout_s, default=10.0,
                   help="seconds a client gets to send a request's headers before its connection is closed "
                        "(default 10)")
    p.add_argument("--body-timeout", type=a.timeout_s, default=30.0,
                   help="seconds a client gets to send a request's body, 408 after (default 30)")
    p.add_argument("--max-waiting", type=a.bounded_int(1, 1 << 20), default=256,
                   help="requests waiting for their first token before new ones get 429 (default 256)")
    p.add_argument("--shutdown-timeout", type=a.timeout_s, default=30.0,
                   help="seconds in-flight requests get to finish after SIGTERM/SIGINT (default 30)")
    p.add_argument("--mode", type=compose_mode, choices=MODES, default=envs.get("CPKV_COMPOSE_MODE"),
                   help="compose mode, listed below (default CPKV_COMPOSE_MODE, symm)")
    p.add_argument("--num-layers", type=a.layers, help="override the model's depth")
    p.add_argument("--experts", type=a.experts, help="routed experts per MoE layer: fewer than the model's keeps every dimension and the depth and routes over that many (one rank's share at cp N on one GPU, e.g. --model glm5 --experts 32); presets only")
    p.add_argument("--seed", type=a.seed, default=0, help="seed of a preset's random weights")
    p.add_argument("--policy", choices=("solo", "mix"), default="solo", help="admission policy")
    p.add_argument("--page-size", type=a.page_size, default=DEFAULT_PAGE_SIZE,
                   help=f"tokens per KV page (default {DEFAULT_PAGE_SIZE})")
    p.add_argument("--pages-per-rank", type=a.bounded_int(2, a.MAX_PAGES), default=None,
                   help=f"device pool pages per rank (page 0 reserved; default {SIZES.pages_per_rank}, or as "
                        "--mem-fraction-static sizes it)")
    p.add_argument("--mem-fraction-static", type=a.bounded_float(0.0, 1.0), metavar="F",
                   help="size the KV pool from the memory plan (cpkv plan): the largest pool with which everything "
                        "a rank keeps fits in F of its share of the GPU (on CPU: of the host's available memory)")
    p.add_argument("--host-pages", type=a.bounded_int(0, a.MAX_PAGES), default=0, help="host-tier page slots (CP-wide)")
    p.add_argument("--chunk-size", type=a.tokens, default=SIZES.chunk_size,
                   help=f"new tokens per batch, and the chunk a long prompt is cut into (default {SIZES.chunk_size})")
    p.add_argument("--max-requests", "--max-running-requests", dest="max_requests", type=a.batch_requests,
                   default=SIZES.max_requests, help=f"requests (prefills and decode steps) per batch (default "
                   f"{SIZES.max_requests}); every running "
                   "generation takes a decode step per batch, so this is SGLang's --max-running-requests")
    p.add_argument("--strategy", choices=STRATEGIES, default="zigzag", help="how new pages split over ranks")
    p.add_argument("--precision", choices=("fp8", "exact"), default="fp8",
                   help="fp8 KV rows (default), or exact: rows, indexer keys and queries in the model dtype")
    p.add_argument("--weights", choices=("auto", "fp8", "bf16"), default="auto",
                   help="linear weights: fp8 (block-scaled fp8 GEMMs), bf16, auto (default: fp8 for an fp8 checkpoint "
                        "on CUDA at fp8 precision, else bf16)")
    p.add_argument("--graph-tokens", type=a.bounded_int(0, 1 << 16), default=None, metavar="N",
                   help="a rank's batches (prefill chunks and decode steps) of up to N tokens run each layer's "
                        "token-only pieces as CUDA graphs, captured at start (default: 1024 with --device cuda at "
                        "fp8 precision, else 0: off)")
    p.add_argument("--decode", choices=("paged", "extend"), default=None,
                   help="decode steps: paged (every running generation advances in one batched step that reads the "
                        "KV where it lies; the default; on CUDA at cp 1 one CUDA graph per batch and context bucket, "
                        "CPKV_DECODE_STEP) or extend (each token a one-token prefill over the cached prefix)")
    p.add_argument("--warmup", action=argparse.BooleanOptionalAction, default=None,
                   help="run one chunked prompt and two decode steps before listening (default: on with --device "
                        "cuda, so that kernel JIT and autotuning stay out of the first requests' TTFT)")
    p.add_argument("--timeout", type=a.timeout_s, default=600.0,
                   help="seconds a collective (or the ranks' start) may take before the ranks are failed")
    p.add_argument("--log-level", choices=LEVELS, default="info", help="the server's log lines (default info)")
    p.add_argument("--log-requests", action="store_true", help="an access line per HTTP request")
    p.add_argument("--decode-log-interval", type=a.bounded_int(1, 1 << 20), default=40, metavar="N",
                   help="a decode line every N engine steps that generate (default 40)")


def run(args: argparse.Namespace) -> int:
    from cpkv.cli.args import as_flags, flags_of
    from cpkv.cli.plan_cmd import check_run
    from cpkv.cli.run_cmd import engine_config
    from cpkv.config import SIZES

    try:
        import prometheus_client, starlette, uvicorn  # noqa: F401, E401
    except ImportError as exc:
        raise ConfigError(f"cpkv serve needs {exc.name}: pip install 'cpkv[serve]'") from None
    warmup, args.warmup = args.warmup, False  # engine_config's warm-up replays a trace; serve warms up below
    if args.mem_fraction_static is not None and args.pages_per_rank is not None:
        raise ConfigError("--mem-fraction-static sizes the pool that --pages-per-rank gives: drop one of them")
    fraction, args.pages_per_rank = args.mem_fraction_static, args.pages_per_rank or SIZES["toy"].pages_per_rank
    with as_flags(flags_of(FLAGS)):
        cfg = replace(engine_config(args, args.cp), decode=args.decode or default_decode(args.device))
        if fraction is not None:
            cfg = replace(cfg, pages_per_rank=pool_for_fraction(cfg, fraction))
            args.pages_per_rank = cfg.pages_per_rank
    check_run(cfg, cfg.model_config())  # the memory plan: a configuration that does not fit is one line
    sock = _bind(args.host, args.port)
    _warn_if_exposed(sock, args.api_key)
    args.warmup = warmup
    try:
        return _serve(args, cfg, sock)
    finally:
        sock.close()


def pool_for_fraction(cfg, fraction: float) -> int:
    """Pages per rank: the largest pool with which the memory plan of ``cfg`` fits ``fraction`` of a rank's budget
    (``cpkv.cli.plan_cmd.rank_budget``); ConfigError when no useful pool fits."""
    from cpkv.cli.args import MAX_PAGES
    from cpkv.cli.plan_cmd import rank_budget, run_setup
    from cpkv.memplan import GB, plan_memory

    got = rank_budget(cfg)
    if got is None:
        raise ConfigError("--mem-fraction-static: this machine does not say how much memory it has; give "
                          "--pages-per-rank instead")
    total, sharing, where = got
    plan = plan_memory(run_setup(cfg, cfg.model_config(), int(total * fraction) // sharing, None))
    if not plan.fits:
        raise ConfigError(f"--mem-fraction-static {fraction:g}: {fraction:g} of {where} ({total / sharing / GB:.1f}"
                          f" GB) holds no useful KV pool (everything needs {plan.total / GB:.2f} GB at the smallest): "
                          "raise it (cpkv plan shows every item)")
    return min(plan.pages, MAX_PAGES)


def _api_key(text: str) -> str:
    """An argparse type: the API key (printable ASCII, no spaces: it travels in an HTTP header)."""
    from cpkv import envs

    try:
        return envs.REGISTRY["CPKV_API_KEY"].parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected {exc}") from None


def served_name(model: str, served_model_name: str | None) -> str:
    """The model id clients see: --served-model-name, else a preset's name or the checkpoint directory's base
    name (never its path: an answer must not tell clients where the server's files are)."""
    if served_model_name:
        return served_model_name
    path = Path(model)
    if path.is_dir():
        return path.resolve().name or "model"
    return model


def _bind(host: str, port: int) -> socket.socket:
    where = f"--host {host} --port {port}: cannot listen there"
    try:
        family, _, _, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except (socket.gaierror, UnicodeError) as exc:
        raise ConfigError(f"{where} (--host {host!r} does not resolve to an address: "
                          f"{getattr(exc, 'strerror', None) or exc}); give an address of this machine, e.g. "
                          "127.0.0.1") from None
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(addr)
    except OSError as exc:
        sock.close()
        raise ConfigError(f"{where} ({exc.strerror}); {_bind_advice(exc.errno, host)}") from None
    return sock


def _bind_advice(err: int | None, host: str) -> str:
    if err == errno.EADDRNOTAVAIL:
        return f"{host} is not an address of this machine: give one of its own (127.0.0.1 for this machine alone)"
    if err == errno.EACCES:
        return "ports below 1024 need privileges: pick another port (--port 0 picks a free one)"
    if err == errno.EADDRINUSE:
        return "another process holds it: pick another port (--port 0 picks a free one)"
    return "check --host, or pick another port (--port 0 picks a free one)"


def _warn_if_exposed(sock: socket.socket, api_key: str | None) -> None:
    """A warning line when the server is reachable from other machines and answers anyone."""
    addr = sock.getsockname()[0].split("%")[0]
    if api_key or _loopback(addr):
        return
    _say(f"warning: listening on {addr}, reachable from other machines, without an API key: anyone who can reach "
         "it can use the model (set --api-key or CPKV_API_KEY, or --host 127.0.0.1)")


def _loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback


def default_max_body(max_prompt_tokens: int) -> int:
    """Bytes: ``BODY_BYTES_PER_TOKEN`` per token of the longest prompt, in whole MiB, at least 1 MiB."""
    return max(1, math.ceil(max_prompt_tokens * BODY_BYTES_PER_TOKEN / (1 << 20))) << 20


def _serve(args: argparse.Namespace, cfg, sock: socket.socket) -> int:
    import uvicorn

    from cpkv.engine.client import EngineClient
    from cpkv.serve.app import ServeState, build_app
    from cpkv.serve.conn import deadline_protocol
    from cpkv.serve.frontend import Frontend
    from cpkv.serve.metrics import Metrics
    from cpkv.serve.logs import StepLog, log_config
    from cpkv.serve.output import generation_eos_ids
    from cpkv.serve.tokenizer import load_tokenizer

    metrics = Metrics()
    hooks = _Hooks()
    client = EngineClient(cfg, timeout_s=args.timeout, on_exit=hooks.engine_exited, on_step=hooks.step)
    tok = load_tokenizer(args.model, args.tokenizer, args.chat_template)
    fe = Frontend(client, metrics, args.max_waiting)
    steps = StepLog(fe.prompt_len, fe.counts, cfg.cp * (cfg.pages_per_rank - 1), args.decode_log_interval)
    hooks.on_step = (metrics.step, steps.step)
    _say(f"starting {cfg.cp} rank processes (model {args.model}, {cfg.device}, mode {cfg.mode})")
    try:
        client.start(ready_timeout_s=args.timeout)
    except BaseException:  # a rank failed while starting, or an interrupt: no rank outlives the command
        client.group.stop()
        raise
    try:
        if args.warmup if args.warmup is not None else cfg.device == "cuda":
            _warm_up(client, cfg, args.timeout)
        name = served_name(args.model, args.served_model_name)
        max_body = int(args.max_body_mb * (1 << 20)) if args.max_body_mb else \
            default_max_body(client.model_cfg.max_context)
        app = build_app(ServeState(fe, tok, name, max_body, args.body_timeout, args.api_key,
                                   generation_eos_ids(args.model),
                                   context_length(args.context_length, client.model_cfg.max_context),
                                   server_info(args, cfg)))
        config = uvicorn.Config(app, log_config=log_config(args.log_level), log_level=args.log_level,
                                access_log=args.log_requests, lifespan="off",
                                timeout_graceful_shutdown=10, timeout_keep_alive=KEEP_ALIVE_S,
                                http=deadline_protocol(args.header_timeout, args.body_timeout))
        server = _make_server(config, fe, args.shutdown_timeout)
        hooks.server = server
        host, port = sock.getsockname()[:2]
        _say(f"listening on http://{_url_host(host)}:{port} (model {name}, cp {cfg.cp}, "
             f"{'tokenizer' if tok else 'token ids only'}{', API key required' if args.api_key else ''})")
        server.run(sockets=[sock])
    finally:
        with contextlib.suppress(Exception):  # a failure is the client's, raised below
            client.close(timeout_s=30.0)
    if client.failure is not None:
        raise client.failure
    _say("stopped: every rank ended")
    return 0


def context_length(given: int | None, model_max: int) -> int:
    """Tokens a request may hold: ``--context-length`` (at most the model's), else the model's."""
    if given is not None and given > model_max:
        raise ConfigError(f"--context-length {given}: the model holds at most {model_max} tokens")
    return given or model_max


def server_info(args: argparse.Namespace, cfg) -> dict:
    """The settings ``/get_server_info`` reports (SGLang's names where they exist)."""
    return {"model_path": args.model, "tokenizer_path": args.tokenizer or args.model,
            "served_model_name": served_name(args.model, args.served_model_name), "host": args.host,
            "port": args.port, "cp_size": cfg.cp, "device": cfg.device, "mode": cfg.mode,
            "chunked_prefill_size": cfg.chunk_size, "page_size": cfg.page_size,
            "pages_per_rank": cfg.pages_per_rank, "host_pages": cfg.host_pages, "max_running_requests":
            cfg.max_requests, "max_queued_requests": args.max_waiting, "schedule_policy": cfg.policy,
            "strategy": cfg.strategy, "precision": cfg.precision, "weights": cfg.weights_dtype,
            "graph_tokens": cfg.graph_tokens, "decode": cfg.decode, "mem_fraction_static": args.mem_fraction_static,
            "context_length": args.context_length, "chat_template": args.chat_template,
            "api_key_required": bool(args.api_key), "log_level": args.log_level, "log_requests": args.log_requests}


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _warm_up(client, cfg, timeout_s: float) -> None:
    """One prompt of two chunks and a page, generating 3 tokens, through the engine (not counted in /metrics)."""
    from cpkv.engine.protocol import Finished
    from cpkv.scheduler.trace import synth_tokens

    n = min(2 * cfg.chunk_size + cfg.page_size, client.model_cfg.max_context - 3)
    done: list = []
    ended = threading.Event()

    def on_event(ev) -> None:
        if isinstance(ev, Finished):
            done.append(ev)
            ended.set()

    _say(f"warming up: a {n}-token prompt and 3 tokens")
    client.submit(synth_tokens("cpkv-serve-warmup", n, client.vocab_size), 3, on_event)
    if not ended.wait(timeout_s) or done[0].reason != "length":
        raise RankFailure(f"the warm-up request did not finish: {done[0] if done else 'timed out'}")


def _say(text: str) -> None:
    print(f"cpkv serve: {text}", file=sys.stderr, flush=True)


class _Hooks:
    """The engine client's exit, turned into the server's end (on the event loop); its step reports, handed on."""

    server = None  # the uvicorn server, once it exists
    on_step: tuple = ()

    def step(self, step) -> None:
        for f in self.on_step:
            f(step)

    def engine_exited(self, exc) -> None:
        server = self.server
        if server is None or server.loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop has closed already
            server.loop.call_soon_threadsafe(server.engine_failed, str(exc) if exc else "the ranks stopped")


def _make_server(config, fe, drain_s: float):
    import uvicorn

    class _Server(uvicorn.Server):
        """uvicorn's server with cpkv's stop: the first signal drains (503 to new requests, in-flight ones get
        the shutdown timeout), a second one stops at once; signals are not re-raised afterwards (exit 0)."""

        def __init__(self, config, fe, drain_s: float) -> None:
            super().__init__(config)
            self.fe, self.drain_s = fe, drain_s
            self.loop: asyncio.AbstractEventLoop | None = None
            self.stopping = False

        async def startup(self, sockets=None) -> None:
            self.loop = asyncio.get_running_loop()
            await super().startup(sockets=sockets)

        @contextlib.contextmanager
        def capture_signals(self):
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            sigs = [getattr(signal, s) for s in STOP_SIGNALS if hasattr(signal, s)]
            old = {sig: signal.signal(sig, self.handle_exit) for sig in sigs}
            try:
                yield
            finally:
                for sig, handler in old.items():
                    signal.signal(sig, handler)

        def handle_exit(self, sig, frame) -> None:
            if self.stopping or self.loop is None:
                self.fe.fail_all("the server is stopping now (a second signal)")
                self.should_exit = True
                return
            self.stopping = True
            _say(f"{signal.Signals(sig).name}: draining (in-flight requests get {self.drain_s:g} s)")
            self.loop.call_soon_threadsafe(lambda: asyncio.ensure_future(self._drain()))

        async def _drain(self) -> None:
            await self.fe.drain(self.drain_s)
            self.should_exit = True

        def engine_failed(self, why: str) -> None:
            _say(f"the engine stopped: {why}")
            self.fe.draining = True
            self.fe.fail_all(why)
            self.should_exit = True

    return _Server(config, fe, drain_s)


def default_decode(device: str) -> str:
    """``paged`` on every device: tested on the CPU (bit for bit against the reference at cp 1, greedy tokens at cp
    2 and 4) and on an H200 (its step's forms against the reference run token by token at cp 1 and 2, sync-free;
    2.2-6.2 ms a step at GLM-5's shapes, 4 layers, where a one-token extend took 20-85 ms: BENCHMARKS.md). The
    device argument stays for a device where it is not (none now)."""
    del device
    return "paged"

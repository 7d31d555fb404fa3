"""Time per output token of the online engine on the CPU, paged decode against extend, over the context length
(docs/design.md §11). The tiny model through ``EngineClient`` (rank processes, no HTTP): per context L a prompt of L
tokens is prefilled and cached once, then sent again for 1 and for 1 + N new tokens; the time per output token is
the difference over N. A CPU figure of the code paths' scaling, not of any GPU.

    PYTHONPATH=src python benchmarks/decode_tpot_cpu.py [--cp 2] [--keys 256,2048,8192] [--new 16]
"""
from __future__ import annotations

import argparse
import threading
import time

from cpkv.engine.client import EngineClient
from cpkv.engine.config import EngineConfig
from cpkv.engine.protocol import Finished


def _generate(client: EngineClient, prompt: list[int], n: int) -> float:
    done = threading.Event()
    t0 = time.perf_counter()
    client.submit(prompt, n, lambda ev: done.set() if isinstance(ev, Finished) else None)
    assert done.wait(600)
    return time.perf_counter() - t0


def tpot(decode: str, cp: int, keys: list[int], new: int) -> dict[int, float]:
    cfg = EngineConfig(cp=cp, decode=decode, page_size=64, chunk_size=4096, max_requests=4,
                       pages_per_rank=max(keys) // 64 * 2 + 64)
    client = EngineClient(cfg, timeout_s=600)
    client.start(ready_timeout_s=600)
    out = {}
    try:
        for n in keys:
            prompt = [(7 * i + n) % 500 + 3 for i in range(n)]
            _generate(client, prompt, 1)  # cold: prefill and cache it
            one = min(_generate(client, prompt, 1) for _ in range(2))
            many = min(_generate(client, prompt, 1 + new) for _ in range(2))
            out[n] = (many - one) / new
    finally:
        client.close(60)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cp", type=int, default=2)
    ap.add_argument("--keys", default="256,2048,8192")
    ap.add_argument("--new", type=int, default=16)
    args = ap.parse_args()
    keys = [int(x) for x in args.keys.split(",")]
    rows = {d: tpot(d, args.cp, keys, args.new) for d in ("extend", "paged")}
    print(f"tiny, cp {args.cp}, CPU: ms per output token ({args.new} tokens after the first, best of 2)")
    print("  keys   extend    paged")
    for n in keys:
        print(f"{n:6d} {rows['extend'][n] * 1e3:8.2f} {rows['paged'][n] * 1e3:8.2f}")


if __name__ == "__main__":
    main()

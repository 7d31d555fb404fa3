"""Host ms of one batch's plan on the CPU (2026-12-01, issue 14): the 90 %-cached 32K batch of ``cpkv bench
engine`` (29,440 cached + 3,328 new tokens, page 64, GLM-5 shapes), per rank 0 of cp 1 and 2, and the last
32K chunk of its cold 128K prompt (98,304 cached + 32,768 new) and the cold 32K batch (nothing planned ahead of it:
its plan runs while the GPU waits or runs only the first layer) at cp 1, and a cached turn of a 200K-token
conversation (196,608 cached + 3,584 new) at cp 8, median of N.

    PYTHONPATH=src python3 benchmarks/plan_host.py [N]

Parts: the batch layout (its prefix pages given, as the engine gives them), the compose plan, the rank plan (token ids, positions, rotary tables, indexer chunk
plan; its device math runs on the CPU here) and the indexer logits work items of the H200 Gluon kernel's
shape (rows 4, 64-key tiles, spans of 64, 132 SMs x 4 programs, last wave split 4): the forward used to
build those on first use inside layer 0, the plan builds them now. No GPU, no Triton needed.
"""
from __future__ import annotations

import statistics
import sys
import time
from types import SimpleNamespace

import torch

from cpkv.compose.plan import ComposePlan
from cpkv.config import preset
from cpkv.engine.forward import BatchSpec, rank_plan
from cpkv.kernels.mqa_logits.work import WorkShape, logits_work_items
from cpkv.layout import build_layout
from cpkv.model.ops import Rotary

P, CACHED, NEW = 64, 29440, 3328
LONG_CHUNK = (98304, 32768)
COLD = (0, 32768)
TURN_200K = (196608, 3584)  # a cached turn of a 200K-token conversation, at cp 8 (the case the design exists for)
SHAPE = WorkShape(rows=4, tile=64, span=64, slots=132 * 4, split=4)


def median_ms(fn, n: int) -> float:
    fn()
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times) * 1e3


def main(n: int) -> None:
    torch.set_num_threads(1)
    cfg = preset("glm5")
    model = SimpleNamespace(cfg=cfg, device=torch.device("cpu"),
                            rotary=lambda pos: Rotary.build(pos, cfg.qk_rope_head_dim, cfg.rope))
    page_bytes = {k: P * cfg.row_bytes(k) for k in ("token", "index")}
    for cp, (cached, new) in ((1, (CACHED, NEW)), (2, (CACHED, NEW)), (1, LONG_CHUNK), (1, COLD), (8, TURN_200K)):
        owners = [(k % cp, 1 + k // cp) for k in range(cached // P)]  # as the engine passes them: explicit pages
        lay = build_layout([(cached, new)], page_size=P, cp=cp, prefix_pages=[owners])
        ids = list(range(1, lay.num_current + 1))
        spec = BatchSpec(lay, (tuple(range(cached + new)),), tuple(ids))
        ip = rank_plan(spec, 0, model).complete(model).indexer

        def items() -> None:
            for c in ip.chunks:
                r = slice(c.row_start, c.row_end)
                logits_work_items(ip.host_ks[r], ip.host_ke[r], c.key_start, c.width, SHAPE)

        parts = {"layout": lambda: build_layout([(cached, new)], page_size=P, cp=cp, prefix_pages=[owners]),
                 "compose plan": lambda: ComposePlan(lay, 0, 200, page_bytes, torch.device("cpu"), ids),
                 "rank plan": lambda: rank_plan(spec, 0, model).complete(model),
                 "work items": items}
        res = {k: median_ms(f, n) for k, f in parts.items()}
        print(f"{cached} cached + {new} new, cp {cp} rank 0 ({ip.num_tokens} query rows, {len(ip.chunks)} chunk(s)): "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in res.items()))


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 50)

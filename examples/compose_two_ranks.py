"""Two rank processes compose a batch's dense KV from each other's pools (CPU: gloo + shared memory).

Run: python examples/compose_two_ranks.py
"""
from __future__ import annotations

import torch

from cpkv.compose import ComposeRuntime
from cpkv.config import AdmissionCaps, preset
from cpkv.dist import launch
from cpkv.layout import build_layout

MODEL, P = preset("tiny"), 16
CAPS = AdmissionCaps(chunk_size=256, max_requests=4)


def rank_main(ctx) -> str:
    rt = ComposeRuntime.create(ctx, MODEL, num_pages=32, page_size=P, caps=CAPS, num_layers=1, mode="symm")
    # request 0 has 2 cached pages (page 5 on rank 0, page 3 on rank 1) and 40 new tokens; request 1 is cold
    layout = build_layout([(32, 40), (0, 20)], page_size=P, cp=ctx.world_size,
                          prefix_pages=[[(0, 5), (1, 3)], []])
    writers = [c.writer for c in layout.current_pages]
    page_ids = [10 + i for i in range(len(writers))]  # writer-side pool pages (normally from the allocator)
    plan = rt.plan_batch(layout, page_ids)
    rows = rt.current_rows(plan, 0, "token")
    kv = torch.full((plan.query_rows.numel(), MODEL.row_bytes("token")), 100 + ctx.rank, dtype=torch.uint8)
    rows.index_copy_(0, plan.query_rows, kv)          # this rank's KV rows of its query tokens
    dense = rt.compose(plan, 0, "token")               # uint8 [num_slots * P, 196], same bytes on every rank
    return f"rank {ctx.rank}: dense {list(dense.shape)}, writers {writers}, sum {int(dense.sum())}"


if __name__ == "__main__":
    for line in launch(rank_main, 2, device="cpu"):
        print(line)

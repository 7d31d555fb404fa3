"""Compose: every rank gets the batch's dense KV, byte-exact across modes (docs/design.md §4).

    plan.py       ComposePlan: per-batch descriptors, built once by ComposeRuntime.plan_batch, passed to every call
    peer.py       PeerMemory: shared-memory (CPU) / CUDA IPC buffers, probed and agreed over the group
    barrier.py    counting barriers: CountingBarrier (host-shared pads, host wait), DeviceBarrier (device
                  pads, one kernel on the stream)
    staging.py    Staging (two parity halves) and the dense-buffer bump arena
    buffers.py    ComposeBuffers: pool, staging, arena and the source tables over every rank's
    launches.py   GatherLaunches: the Triton gathers, built once per plan and replayed per layer
    prefetch.py   Prefetcher: the next layer's prefix pages gathered ahead (``prefetch`` mode)
    modes.py      span-reduce / batch-reduce / prefix-gather / symm / prefetch, chosen by name
    runtime.py    ComposeRuntime: the per-rank object the engine holds
    dispatch.py   ExpertExchange: the MoE layers' token exchange over the same peer memory and barrier
    reference.py  single-process reference dense buffer
"""
from __future__ import annotations

from cpkv.compose.modes import MODES, get_mode
from cpkv.compose.plan import ComposePlan
from cpkv.compose.runtime import ComposeRuntime

__all__ = ["MODES", "ComposePlan", "ComposeRuntime", "get_mode"]

"""Compose: every rank gets the batch's dense KV, byte-exact across modes (docs/design.md §4).

    plan.py       ComposePlan: per-batch descriptors, built once by ComposeRuntime.prepare, passed to every call
    peer.py       PeerMemory: shared-memory (CPU) / CUDA IPC buffers, probed and agreed over the group
    barrier.py    counting barriers: CountingBarrier (host-shared pads, host wait), DeviceBarrier (device
                  pads, one kernel on the stream)
    staging.py    Staging (two parity halves) and the dense-buffer bump arena
    modes.py      legacy / fused / v2 / symm / prefetch, chosen by name
    runtime.py    ComposeRuntime: the per-rank object the engine holds
    reference.py  single-process reference dense buffer
"""
from __future__ import annotations

from cpkv.compose.modes import MODES, get_mode
from cpkv.compose.plan import ComposePlan
from cpkv.compose.runtime import ComposeRuntime

__all__ = ["MODES", "ComposePlan", "ComposeRuntime", "get_mode"]

"""KV cache: page allocator and prefix cache (torch-free), pools and host tier (torch).

The torch-free parts import without torch; ``KVPool``/``HostTier`` load lazily.
"""
from __future__ import annotations

from cpkv.kvcache.allocator import PageAllocator
from cpkv.kvcache.prefix_cache import Match, Node, PrefixCache

__all__ = ["PageAllocator", "PrefixCache", "Match", "Node", "KVPool", "HostTier"]


def __getattr__(name: str):
    if name == "KVPool":
        from cpkv.kvcache.pool import KVPool
        return KVPool
    if name == "HostTier":
        from cpkv.kvcache.host import HostTier
        return HostTier
    raise AttributeError(name)

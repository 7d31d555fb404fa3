"""The KV cache: who holds which page, and the bytes.

    manager.py       KVCacheManager: the one owner of the prefix cache, the allocators and the host tier's
                     slots (match / hold / drop / allocate / commit / release / reload); the scheduler and the
                     engine use nothing else. No torch.
    prefix_cache.py  the CP-wide radix tree over full pages, LRU eviction, spill bookkeeping. No torch.
    allocator.py     refcounted page allocator of one pool (page 0 reserved). No torch.
    pool.py          KVPool: one rank's uint8 pages of every layer and both kinds, typed field views (torch)
    host.py          HostTier: the pinned host copy of spilled pages (torch)

Only ``compose`` (gather, persist), ``engine.executor`` (the owner's spill and reload copies) and ``host`` touch
KV bytes; everything else sees page ids.
"""
from __future__ import annotations

from cpkv.kvcache.allocator import PageAllocator
from cpkv.kvcache.manager import EMPTY, KVCacheManager, Prefix
from cpkv.kvcache.prefix_cache import Match, Node, PrefixCache

__all__ = ["EMPTY", "KVCacheManager", "PageAllocator", "Prefix", "PrefixCache", "Match", "Node", "KVPool",
           "HostTier"]


def __getattr__(name: str):
    if name == "KVPool":
        from cpkv.kvcache.pool import KVPool
        return KVPool
    if name == "HostTier":
        from cpkv.kvcache.host import HostTier
        return HostTier
    raise AttributeError(name)

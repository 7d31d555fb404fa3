"""CP-wide prefix cache: a radix tree over chains of full pages. No torch import.

Each node is one full page of tokens and records where its KV lives: (owner rank, page id) on a device
pool, or a slot of the host tier after a spill. Every rank holds the same tree and applies the same calls
in the same order, so every rank takes the same decisions (matches, evictions, spills)::

    root ── [t0..t63] (r0, p7) ── [t64..t127] (r1, p3) ── [t128..t191] (r0, p9)
                                 └─ [t64'..t127'] (r2, p1)

Ownership: an inserted page's reference passes to the tree; eviction gives it back to its owner's
allocator. Requests in flight lock the nodes they use (a node and its ancestors), so those are never
evicted. LRU order uses a logical clock (no wall time), ties broken by node creation order.

Victims come from two heaps keyed (last use, creation order), one over unlocked device leaves and one over
unlocked host leaves, kept up to date lazily: a node is pushed whenever it becomes a candidate or its stamp
changes, and entries that no longer hold (the node left the set, was locked, or was stamped again) are
skipped when they reach the top. Each eviction costs O(log n) amortised instead of a scan of every leaf, and
the victims are exactly those of that scan (tests/kvcache/test_prefix_cache_heap.py compares both).
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np

from cpkv.errors import PageError
from cpkv.kvcache.allocator import PageAllocator


@dataclass(eq=False)
class Node:
    key: bytes  # the page's token ids (or page keys) as int64 bytes (``PrefixCache._keys``)
    parent: "Node | None"
    owner: int
    page_id: int  # >= 1 while on a device pool, -1 while on the host tier
    host_slot: int = -1
    nid: int = 0
    last_use: int = 0
    lock: int = 0
    device_children: int = 0
    children: dict[bytes, "Node"] = field(default_factory=dict)

    @property
    def on_device(self) -> bool:
        return self.page_id >= 1


@dataclass(frozen=True)
class Match:
    """Longest cached page-aligned prefix: ``num_tokens`` tokens in ``nodes`` (one per page)."""

    num_tokens: int
    nodes: tuple[Node, ...]

    @property
    def pages(self) -> list[tuple[int, int]]:
        """(owner, page id) of each page; page id −1 for pages on the host tier."""
        return [(n.owner, n.page_id) for n in self.nodes]

    @property
    def host_nodes(self) -> list[Node]:
        return [n for n in self.nodes if not n.on_device]


# on_spill(owner, page_id, host_slot): copy a page's bytes to the host tier before its device page is freed.
SpillHook = Callable[[int, int, int], None]


class PrefixCache:
    """Radix tree over full pages, shared by the CP group. ``allocators[r]`` mirrors rank r's pool."""

    def __init__(self, page_size: int, allocators: Sequence[PageAllocator], host_pages: int = 0) -> None:
        self.page_size = page_size
        self.allocators = list(allocators)
        self.root = Node(key=b"", parent=None, owner=-1, page_id=0)
        self._clock = 0
        self._next_id = 1
        self._device_leaves: set[Node] = set()
        self._host_leaves: set[Node] = set()
        self._device_heap = _LeafHeap(self._device_leaves)  # LRU candidates among device leaves
        self._host_heap = _LeafHeap(self._host_leaves)  # LRU candidates among host-tier leaves
        self.host = PageAllocator(host_pages + 1, "host tier") if host_pages > 0 else None
        self.device_pages = [0] * len(self.allocators)
        self.stats = {"spilled": 0, "reloaded": 0, "evicted": 0}

    # -- lookup ------------------------------------------------------------------------------------
    def _keys(self, tokens: Sequence[int]) -> list[bytes]:
        """One key per full page of ``tokens`` (ints, or an integer numpy array): the page's ids as int64 bytes.
        Equal pages give equal keys whatever the sequence type. Bytes slices of one conversion, because every
        admission's match and every chunk's commit keys the whole prompt: tuples of the ids cost ten times as
        much host time on a 200K-token prompt."""
        P = self.page_size
        n = len(tokens) - len(tokens) % P
        if n <= 0:
            return []
        try:
            raw = np.ascontiguousarray(tokens[:n], dtype=np.int64).tobytes()
        except (OverflowError, TypeError, ValueError) as exc:
            raise PageError(f"prefix cache keys must be integers within int64: {exc}") from None
        w = 8 * P
        return [raw[i:i + w] for i in range(0, 8 * n, w)]

    def match(self, tokens: Sequence[int]) -> Match:
        """Longest cached prefix of ``tokens`` made of full pages; refreshes its LRU stamp."""
        self._clock += 1
        node, nodes = self.root, []
        for key in self._keys(tokens):
            child = node.children.get(key)
            if child is None:
                break
            self._stamp(child)
            nodes.append(child)
            node = child
        return Match(len(nodes) * self.page_size, tuple(nodes))

    # -- insert ------------------------------------------------------------------------------------
    def insert(self, tokens: Sequence[int], pages: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
        """Record ``pages[i]`` = (owner, page id) for the i-th full page of ``tokens``.

        The tree takes over the caller's reference on each page it adopts. Pages whose tokens are already
        cached are not adopted: they are returned, and the caller releases them.
        """
        keys = self._keys(tokens)
        if len(pages) > len(keys):
            raise PageError(f"insert: {len(pages)} pages given for {len(keys)} full pages of tokens")
        self._clock += 1
        node, rejected = self.root, []
        for key, (owner, page_id) in zip(keys, pages):
            child = node.children.get(key)
            if child is None:
                child = self._add(node, key, owner, page_id)
            elif not child.on_device:  # spilled: adopt the fresh device copy, free the host slot
                child.owner = owner
                self.reload(child, page_id)
                self.stats["reloaded"] -= 1
            else:
                rejected.append((owner, page_id))
            self._stamp(child)
            node = child
        return rejected

    def _add(self, parent: Node, key: tuple[int, ...], owner: int, page_id: int) -> Node:
        if not (0 <= owner < len(self.allocators)):
            raise PageError(f"insert: owner rank must be in [0, {len(self.allocators)}), got {owner}")
        if self.allocators[owner].refcount(page_id) < 1:
            raise PageError(f"insert: page {page_id} of rank {owner} is not allocated")
        node = Node(key, parent, owner, page_id, nid=self._next_id)
        self._next_id += 1
        parent.children[key] = node
        self._host_leaves.discard(parent)
        self._on_device_added(node)
        return node

    # -- locks -------------------------------------------------------------------------------------
    def lock(self, nodes: Sequence[Node]) -> None:
        """Pin the chain ending at ``nodes[-1]`` (and its ancestors) against eviction."""
        self._walk_up(nodes, +1)

    def unlock(self, nodes: Sequence[Node]) -> None:
        self._walk_up(nodes, -1)

    def _walk_up(self, nodes: Sequence[Node], delta: int) -> None:
        node = nodes[-1] if nodes else None
        while node is not None and node is not self.root:
            if node.lock + delta < 0:
                raise PageError("unlock of a node that is not locked")
            node.lock += delta
            if node.lock == 0:
                self._offer(node)
            node = node.parent

    # -- eviction and the host tier ----------------------------------------------------------------
    def evict(self, num_pages: int, owner: int | None = None, on_spill: SpillHook | None = None) -> int:
        """Free device pages, LRU leaves first, until ``num_pages`` are freed (on ``owner`` if given).

        With a host tier and an ``on_spill`` hook, a victim's page is spilled (the hook copies it) and the
        node stays in the tree on the host; otherwise, or when no host slot can be freed, the node is dropped. Returns the
        number of device pages freed that count toward the target.
        """
        freed = 0
        while freed < num_pages:
            node = self._device_heap.pop()
            if node is None:
                break
            counts = owner is None or node.owner == owner
            self._evict_device(node, on_spill)  # a parent left without device children joins the heap
            freed += int(counts)
        return freed

    def _evict_device(self, node: Node, on_spill: SpillHook | None) -> Node | None:
        owner, page_id = node.owner, node.page_id
        # without a hook nothing would copy the bytes: drop the node rather than keep an empty host page
        slot = self._host_slot() if self.host is not None and on_spill is not None else -1
        if slot > 0:
            on_spill(owner, page_id, slot)
        self._on_device_removed(node)
        self.allocators[owner].release([page_id])
        node.page_id = -1
        if slot > 0:
            node.host_slot = slot
            self.stats["spilled"] += 1
            if not node.children:
                self._add_host_leaf(node)
        else:
            self._drop(node)
        self.stats["evicted"] += 1
        return node.parent if node.parent is not self.root else None

    def _host_slot(self) -> int:
        assert self.host is not None
        if self.host.num_free == 0:
            victim = self._host_heap.pop()
            if victim is None:
                return -1
            self._drop_host(victim)
        return self.host.allocate(1)[0]

    def _drop_host(self, node: Node) -> None:
        assert self.host is not None
        self.host.release([node.host_slot])
        node.host_slot = -1
        self._drop(node)

    def _drop(self, node: Node) -> None:
        self._host_leaves.discard(node)
        parent = node.parent
        assert parent is not None and not node.children
        del parent.children[node.key]
        if parent is not self.root and not parent.children and not parent.on_device:
            self._add_host_leaf(parent)

    def reload(self, node: Node, page_id: int) -> int:
        """A spilled node's bytes were copied back into ``page_id`` of its owner; returns its host slot."""
        if node.on_device or node.host_slot < 1:
            raise PageError("reload: node is not on the host tier")
        assert self.host is not None
        slot = node.host_slot
        self.host.release([slot])
        node.host_slot, node.page_id = -1, page_id
        self._host_leaves.discard(node)
        self._on_device_added(node)
        self.stats["reloaded"] += 1
        return slot

    # -- bookkeeping -------------------------------------------------------------------------------
    def _stamp(self, node: Node) -> None:
        """Mark ``node`` used now; a leaf candidate is re-pushed under its new stamp."""
        node.last_use = self._clock
        self._offer(node)

    def _offer(self, node: Node) -> None:
        """Push ``node`` on the heap of its leaf set, if it is an unlocked leaf (no-op otherwise)."""
        if node.lock == 0:
            if node in self._device_leaves:
                self._device_heap.push(node)
            elif node in self._host_leaves:
                self._host_heap.push(node)

    def _add_device_leaf(self, node: Node) -> None:
        self._device_leaves.add(node)
        self._offer(node)

    def _add_host_leaf(self, node: Node) -> None:
        self._host_leaves.add(node)
        self._offer(node)

    def _on_device_added(self, node: Node) -> None:
        self.device_pages[node.owner] += 1
        parent = node.parent
        if parent is not None and parent is not self.root:
            parent.device_children += 1
            self._device_leaves.discard(parent)
        if node.device_children == 0:
            self._add_device_leaf(node)

    def _on_device_removed(self, node: Node) -> None:
        self.device_pages[node.owner] -= 1
        self._device_leaves.discard(node)
        parent = node.parent
        if parent is not None and parent is not self.root:
            parent.device_children -= 1
            if parent.device_children == 0 and parent.on_device:
                self._add_device_leaf(parent)

    @property
    def num_device_pages(self) -> int:
        return sum(self.device_pages)

    def evictable_pages(self, owner: int | None = None) -> int:
        """Device pages that eviction could free now: nodes with no lock on them or on any descendant."""
        count = 0
        stack = [self.root]
        while stack:
            node = stack.pop()
            for child in node.children.values():
                if child.lock == 0 and child.on_device and (owner is None or child.owner == owner):
                    count += 1
                stack.append(child)
        return count


class _LeafHeap:
    """Lazy min-heap of the unlocked nodes of ``members``, ordered by (last use, creation order).

    ``push`` adds an entry for a node's current stamp; ``pop`` returns the least recently used node that is
    still an unlocked member under the stamp it was pushed with (stale entries are dropped on the way). A
    node may sit in the heap several times; stale entries are dropped when they reach the top and, once the
    heap holds over twice as many entries as there are members, by a rebuild from the members (amortised
    O(1) per push).
    """

    def __init__(self, members: set[Node]) -> None:
        self.members = members
        self._heap: list[tuple[int, int, int, Node]] = []  # (last_use, nid, push counter, node)
        self._pushes = 0

    def push(self, node: Node) -> None:
        self._pushes += 1
        heapq.heappush(self._heap, (node.last_use, node.nid, self._pushes, node))
        if len(self._heap) > 2 * len(self.members) + 64:  # mostly stale: rebuild from the members
            self._heap = [(n.last_use, n.nid, self._pushes, n) for n in self.members if n.lock == 0]
            heapq.heapify(self._heap)

    def pop(self) -> Node | None:
        while self._heap:
            entry = heapq.heappop(self._heap)
            if self._valid(entry):
                return entry[3]
        return None

    def _valid(self, entry: tuple[int, int, int, Node]) -> bool:
        node = entry[3]
        return node.lock == 0 and node.last_use == entry[0] and node in self.members

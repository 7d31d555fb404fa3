"""CP-aware admission and trace replay (docs/design.md §7). No torch import anywhere in this package.

Modules: ``request`` (a prompt and its progress), ``admission`` (caps, policies, ``PrefillAdder.try_add``),
``batch`` (what the engine runs), ``scheduler`` (queue + batch loop), ``trace`` (trace files, the
built-in trace, token synthesis), ``costs`` (batch cost model), ``replay`` (event-driven simulation;
its command is ``cpkv.cli.replay_cmd``).

One request's token ranges while it runs (P = page size; every boundary but ``prompt_len`` is a
multiple of P, except an unaligned prefix, which always runs alone)::

    0            cached           done          done+extend_len          prompt_len
    |  cache hit  | earlier chunks |  this chunk  |  rest (later chunks)  |
    |<------ carried prefix ------>|
    entry.prefix_len = done        entry.extend_len (≤ the chunk size, in whole pages)

The engine's loop::

    sched = Scheduler(kv, caps, model=model, cp=cp_config, staging_pages=runtime_staging_pages)
    sched.add(Request(rid, tokens, len(tokens)))        # tokens: materialize_tokens(trace)[rid]
    batch = sched.next_batch()   # Batch.entries[i]: request, prefix_len, extend_len, chunked, last_chunk,
                                 #   prefix (held), prefix_pages / pages (owner, page id), writers
    layout = batch.layout()      # build_layout(...) with the entries' prefix pages: same writers
    ...                          # forward: write each entry's new KV into entry.pages
    finished = sched.postprocess(batch)   # full pages committed to the KV cache (writers own them), partial
                                     # pages released, prefix dropped, next chunk requeued first

``kv`` is the ``cpkv.kvcache.KVCacheManager``: the scheduler reaches the cache through its verbs only.
"""
from __future__ import annotations

from cpkv.scheduler.admission import POLICIES, REASONS, Admission, Admitted, PrefillAdder, Rejected
from cpkv.scheduler.batch import Batch, Entry
from cpkv.scheduler.request import Request, Status
from cpkv.scheduler.scheduler import Scheduler

__all__ = ["Admission", "Admitted", "Batch", "Entry", "POLICIES", "PrefillAdder", "REASONS", "Rejected",
           "Request", "Scheduler", "Status"]

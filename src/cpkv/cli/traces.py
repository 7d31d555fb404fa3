"""The built-in trace of ``cpkv run``: a few short multi-turn conversations at toy lengths. No torch import.

Derived from the scheduler's built-in long-context trace, scaled by 1/128 (prompts of about 200-700
tokens, so the tiny preset's top-k of 64 runs sparse selection) with short think times and about four
turns per conversation, so that turns of one conversation follow each other (prefix hits) and one
prompt is longer than the default chunk of 512 tokens.
"""
from __future__ import annotations

from cpkv.scheduler.trace import BuiltinShape, TraceRequest, builtin_trace

SHAPE = BuiltinShape(rate=1.5, fresh_share=0.06, fresh_len=(16384, 131072), root_len=(16384, 98304),
                     turn_len=(256, 3072), mean_turns=4.0, think_s=(0.1, 0.5), branch_p=0.05, max_len=196608)
SCALE = 1 / 128


def default_trace(n: int = 12, seed: int = 0, long: int = 0) -> list[TraceRequest]:
    """The built-in trace of ``n`` requests, plus a two-turn conversation of ``long`` and ``long`` + 512 tokens when
    ``long`` > 0 (its second turn hits the first's pages; past the model's index top-k it runs sparse selection)."""
    trace = builtin_trace(n, seed=seed, scale=SCALE, shape=SHAPE)
    if long:
        trace += [TraceRequest("long.t0", 0.0, long), TraceRequest("long.t1", 0.0, long + 512, parent="long.t0")]
    return trace

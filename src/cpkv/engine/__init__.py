"""The CP prefill engine behind ``cpkv run`` and ``cpkv serve``.

    config.py       EngineConfig (validated before any rank starts)
    executor.py     BatchExecutor: one rank's resident state and the batch step (plan, forward, look-ahead, chains)
    instruments.py  MeasureConfig (beside an EngineConfig) and Instruments: what a benchmark or test measures
    trace_loop.py   TraceLoop: the trace driver (cpkv run, cpkv bench engine)
    online.py       OnlineLoop: the long-lived driver (cpkv serve)
    rank.py         a trace job's rank entry point, the rank's model
    forward.py      one rank's forward over a batch (RankPlan built once per batch)
    engine.py       launching the ranks, merging their results, single-rank verification
"""

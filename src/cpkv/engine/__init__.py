"""The CP prefill engine behind ``cpkv run``.

    config.py   EngineConfig (validated before any rank starts)
    rank.py     one rank's loop: scheduler -> layout -> compose plan -> forward -> prefix cache
    forward.py  one rank's forward over a batch (RankPlan built once per batch, cached on the layout)
    engine.py   launching the ranks, merging their results, single-rank verification
"""

"""``cpkv serve``: the HTTP front end of the online engine (a harness package: the core never imports it).

Modules: ``cmd`` (the command: options, ranks, uvicorn, signals), ``app`` (Starlette routes: parse, validate,
await, answer), ``protocol`` (request bodies -> ``GenRequest``, ``BadRequest`` naming the field), ``frontend``
(admission to the engine, per-request timing, counting and cancellation), ``metrics`` (Prometheus, declared
once), ``info`` (server / model info, cache flush, tokenize routes), ``logs`` (prefill and decode log lines),
``tokenizer`` (the checkpoint's tokenizer and chat template; ``tiny_tokenizer`` the tiny preset's), ``conn`` (the HTTP connection's deadlines
for slow clients). The engine side is
``cpkv.engine.client`` / ``cpkv.engine.online``; they talk through ``cpkv.engine.protocol``.
"""

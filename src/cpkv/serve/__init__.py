"""``cpkv serve``: the HTTP front end of the online engine (a harness package: the core never imports it).

Modules: ``cmd`` (the command: options, ranks, uvicorn, signals), ``app`` (Starlette routes: parse, validate,
await, answer), ``protocol`` (request bodies -> ``GenRequest``, ``BadRequest`` naming the field), ``frontend``
(admission to the engine, per-request timing, counting and cancellation), ``metrics`` (Prometheus, declared
once), ``tokenizer`` (the checkpoint's tokenizer and chat template), ``conn`` (the HTTP connection's deadlines
for slow clients). The engine side is
``cpkv.engine.client`` / ``cpkv.engine.online``; they talk through ``cpkv.engine.protocol``.
"""

"""The serving engine: many requests through one model, one scheduler step at a time.

`LLMEngine` (`llm_engine`) adds, steps and aborts requests; the `Scheduler` decides which run
next, the `BlockManager` keeps their paged K/V blocks (and the prefix cache), the `ModelRunner`
runs one packed forward call per step over the `PagedKVPool`. `AsyncEngine` is its asyncio front:
one thread owns the engine, handlers talk to it through queues. Per-request metrics follow
vLLM's serving benchmark (`metrics`).
"""

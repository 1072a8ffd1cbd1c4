"""The serving engine: many requests through one model, one scheduler step at a time.

`LLMEngine` adds, steps and aborts requests; the `Scheduler` picks who runs, the `BlockManager`
keeps their paged K/V blocks, the `ModelRunner` runs one packed forward call per step over the
`PagedKVPool`; `AsyncEngine` is its asyncio front."""

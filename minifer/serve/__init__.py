"""Serving: many requests through one model (block manager, scheduler, `LLMEngine`), the
serving benchmark's metrics (:mod:`.metrics`) and synthetic workloads (:mod:`.workload`)."""

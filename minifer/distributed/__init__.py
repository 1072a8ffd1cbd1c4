"""The multi-process wing: the engine in processes of its own.

- `engine_process`: the engine steps in a process of its own, the server's handlers stay behind;
- `replicas`: several engine processes behind one server, each with a share of the seats;
- `handoff` and `disagg`: disaggregated prefill and decode, the prompt's K/V sent between ranks;
- `parallel`: tensor parallelism, one model split across processes or GPUs."""

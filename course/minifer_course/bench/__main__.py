"""``python -m minifer_course.bench COMMAND``: every benchmark behind one entry point.

The table below is the whole list of subcommands: each names the module (in
`minifer_course.bench.commands`) whose ``add_arguments(parser)`` declares its options and whose
``run_command(args)`` runs it.
Modules are imported only for the command that runs.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

COMMANDS: dict[str, tuple[str, str]] = {
    "probe": ("minifer_course.bench.commands.probe", "measure memory bandwidth and matmul FLOP/s of this machine"),
    "decode": ("minifer_course.bench.commands.decode",
               "prefill vs decode, batch sizes, KV cache vs none (reference model, fp32)"),
    "table": ("minifer_course.bench.commands.table",
              "minifer vs the textbook engine and transformers, the matmul floor, GB/s and MBU "
              "(also: decode --table)"),
    "profile": ("minifer_course.bench.commands.profile", "where a decode step's time goes: torch.profiler's top "
                "ops and the step split into matmuls, attention, other ops and Python"),
    "quant": ("minifer_course.bench.commands.quant", "bytes and decode tokens/s per precision (fp32 ... int4)"),
    "peers": ("minifer_course.bench.commands.peers", "minifer beside CTranslate2 and OpenVINO GenAI on the same weights: "
              "greedy agreement and decode tokens/s, engines alternating (the peers extra)"),
    "threads": ("minifer_course.bench.commands.threads",
                "decode tokens/s per thread count (1, all, auto) and OpenMP wait policy, on the "
                "quiet machine and beside a busy core: medians and the spread of rounds"),
    "spec": ("minifer_course.bench.commands.spec", "plain vs speculative decoding (draft model, prompt lookup) on "
             "the shipped Shakespeare pair, greedy, batch 1"),
    "serve": ("minifer_course.bench.commands.serve", "static vs continuous batching on a Poisson workload, and "
              "prefix caching on a shared system prompt (LLMEngine)"),
    "disagg": ("minifer_course.bench.commands.disagg",
               "colocated vs chunked vs disaggregated prefill under steady chats plus long "
               "prompts: the decode stream's ITL p50/p99/max gap, TTFT, K/V bytes moved"),
    "gpu": ("minifer_course.bench.commands.gpu",
            "the course's GPU claims on this GPU: probed bandwidth and bf16 FLOP/s, decode "
            "batch 1-256 eager / CUDA graph / compiled with MBU, prefill TFLOP/s, speculative "
            "speed-up, serving at saturation (--quick: tiny sizes on a CPU)"),
    "serve-load": ("minifer_course.bench.commands.serve_load",
                   "load-test an OpenAI-compatible completions server: Poisson arrivals, "
                   "streaming; TTFT/TPOT/ITL/E2EL, throughput, goodput"),
    "serve-stall": ("minifer_course.bench.commands.serve_stall",
                    "the largest gap in other clients' streams while ~1 MB prompts arrive at "
                    "the HTTP server (python -m minifer.serve in a process of its own)"),
    "serve-vllm": ("minifer_course.bench.commands.serve_vllm",
                   "minifer's server beside vLLM's CPU build (a virtualenv of its own), both "
                   "measured by vLLM's client (vllm bench serve): output tok/s, TTFT, TPOT"),
}


def main(argv: Sequence[str] | None = None) -> int:
    """Parse the command line and run one benchmark; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m minifer_course.bench",
                                     description="minifer's benchmarks: warm-up, device sync, "
                                     "medians, ratios measured in the same run.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["decode"] and "--table" in argv:  # the table's older name
        from .commands.table import from_decode_table

        argv = from_decode_table(argv)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == chosen:  # only the chosen command's module is imported
            importlib.import_module(module).add_arguments(p)
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return importlib.import_module(COMMANDS[args.command][0]).run_command(args) or 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m minifer_course.bench decode``: the prefill/decode report of `minifer_course.bench.decode`
(the engine table is its own command, ``table``)."""

from __future__ import annotations

import argparse

from ..decode import format_report, run
from . import add_machine_options, set_up_machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="reference",
                        help="model preset, random weights (default: reference, 26.8M)")
    add_machine_options(parser)
    parser.add_argument("--prefill-tokens", type=int, default=512,
                        help="prompt length of the prefill timing (default: 512)")
    parser.add_argument("--context", type=int, default=64,
                        help="cached tokens per sequence for the decode timings (default: 64)")
    parser.add_argument("--full", action="store_true",
                        help="cache vs none at 32 and 128 new tokens; default: 32 only, a quick "
                        "scope that answers the same questions in a few minutes")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="decode batch sizes (default: 1 8 32 64)")
    parser.add_argument("--new-tokens", type=int, nargs="*", default=None,
                        help="generation lengths for cache vs no cache (default: 32; "
                        "--full: 32 128)")
    parser.add_argument("--prompt-tokens", type=int, default=64,
                        help="prompt length for cache vs no cache (default: 64)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="counted runs (default: 3)")


def run_command(args: argparse.Namespace) -> int:
    set_up_machine(args)
    batches = [1, 8, 32, 64] if args.batches is None else args.batches
    new_tokens = ([32, 128] if args.full else [32]) if args.new_tokens is None else args.new_tokens
    result = run(args.preset, prefill_tokens=args.prefill_tokens, context=args.context,
                 batches=batches, new_tokens=new_tokens,
                 prompt_tokens=args.prompt_tokens,
                 repeats=3 if args.repeats is None else args.repeats, device=args.device)
    print(format_report(result))
    return 0

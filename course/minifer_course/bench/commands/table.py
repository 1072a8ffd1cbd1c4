"""``python -m minifer_course.bench table``: minifer against the textbook engine and `transformers`,
the matmul floor, GB/s and MBU (`minifer_course.bench.engines` measures).

``python -m minifer_course.bench decode --table`` is the same command under its older name.
"""

from __future__ import annotations

import argparse
import json
import sys

from ..engines import HEADER, format_table, quick_new_tokens, quick_repeats, run_table, to_json
from . import add_machine_options, set_up_machine

OLD_NAMES = {"--table-prompt-tokens": "--prompt-tokens", "--table-new-tokens": "--new-tokens"}
"""``decode --table``'s option names for the options this command names plainly."""


def from_decode_table(argv: list[str]) -> list[str]:
    """``decode --table ARGS`` as ``table ARGS`` (the older spelling of this command)."""
    out = []
    for a in argv:
        name, eq, value = a.partition("=")
        if a == "--table":
            continue
        out.append("table" if a == "decode" else OLD_NAMES.get(name, name) + eq + value)
    return out


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--presets", nargs="+", default=["reference", "gpt2"],
                        help="model shapes (default: reference gpt2)")
    parser.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"],
                        help="precisions (default: fp32 bf16)")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="decode batch sizes (default: 1 64; --full: 1 8 32 64)")
    parser.add_argument("--prompt-tokens", type=int, default=128,
                        help="prompt already in the cache (default: 128)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="decode steps per timed run (default: 8 at batch <= 8, 3 above; "
                        "--full: 16)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="round-robin rounds (default: 5 at batch <= 8 and 3 above; "
                        "--full: 3)")
    parser.add_argument("--full", action="store_true",
                        help="the whole grid: batches 1 8 32 64, 16 new tokens")
    parser.add_argument("--prefill", action="store_true",
                        help="each engine prefills the prompt itself (default: every engine "
                        "starts from the same random K/V, which costs no prefill)")
    parser.add_argument("--compile", action="store_true",
                        help="compile minifer's decode step (torch.compile; slow to start)")
    parser.add_argument("--no-baselines", action="store_true",
                        help="time minifer and the floor only")
    add_machine_options(parser, device=False)
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the table as JSON to PATH")


def run_command(args: argparse.Namespace) -> int:
    set_up_machine(args)
    batches = ([1, 8, 32, 64] if args.full else [1, 64]) if args.batches is None else args.batches
    new_tokens = (16 if args.full else quick_new_tokens) if args.new_tokens is None \
        else args.new_tokens
    print(HEADER, file=sys.stderr, flush=True)
    result = run_table(args.presets, args.dtypes, batches,
                       prompt_tokens=args.prompt_tokens, new_tokens=new_tokens,
                       repeats=(3 if args.full else quick_repeats) if args.repeats is None
                       else args.repeats, compile=args.compile,
                       baselines=not args.no_baselines, prefill=args.prefill,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    result["command"] = "python -m minifer_course.bench " + " ".join(sys.argv[1:])
    print(format_table(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(to_json(result), f, indent=1)
        print(f"wrote {args.json}")
    return 0

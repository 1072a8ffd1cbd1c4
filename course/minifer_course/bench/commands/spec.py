"""``python -m minifer_course.bench spec``: plain against speculative decoding
(`minifer_course.bench.spec` measures)."""

from __future__ import annotations

import argparse

from minifer.checks import parse_threads
from minifer.fast.threads import apply_threads

from ..spec import PROMPT, format_report, run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--k", type=int, default=4, help="draft tokens per target pass (default 4)")
    parser.add_argument("--full", action="store_true",
                        help="add the draft-model sweep over k = 1..4 and time 5 runs; default: "
                        "k only (draft model and prompt lookup), 3 runs")
    parser.add_argument("--ks", type=int, nargs="*", default=None,
                        help="k values of the draft-model sweep (default: none; --full: 1 2 3 4)")
    parser.add_argument("--new-tokens", type=int, default=80, help="tokens generated (default 80)")
    parser.add_argument("--repeats", type=int, default=None,
                        help="counted runs (default 3; --full: 5)")
    parser.add_argument("--threads", type=parse_threads, default=None,
                        help="torch CPU threads, or 'auto': the cores idle now")
    parser.add_argument("--prompt", default=PROMPT, help="the prompt (default: Romeo)")


def run_command(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    ks = ([1, 2, 3, 4] if args.full else []) if args.ks is None else args.ks
    repeats = (5 if args.full else 3) if args.repeats is None else args.repeats
    print(format_report(run(k=args.k, ks=ks, new_tokens=args.new_tokens,
                            repeats=repeats, prompt=args.prompt)))
    return 0

"""``python -m minifer_course.bench profile``: where a decode step's time goes
(`minifer_course.bench.profile` measures)."""

from __future__ import annotations

import argparse
import sys

import torch

from minifer.checks import parse_threads
from minifer.fast.threads import apply_threads
from minifer.model import GPT

from ..profile import DTYPES, ENGINES, format_summary, profile_decode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engines", nargs="+", default=["minifer"], choices=ENGINES,
                        help="engines to profile (default: minifer)")
    parser.add_argument("--preset", default="gpt2", help="model shape (default: gpt2)")
    parser.add_argument("--dtype", default="fp32", choices=list(DTYPES),
                        help="precision (default: fp32)")
    parser.add_argument("--batch", type=int, default=1, help="decode batch (default: 1)")
    parser.add_argument("--prompt-tokens", type=int, default=128,
                        help="cached tokens before the first step (default: 128)")
    parser.add_argument("--steps", type=int, default=4, help="profiled steps (default: 4)")
    parser.add_argument("--rows", type=int, default=12, help="rows of the op table (default: 12)")
    parser.add_argument("--threads", type=parse_threads, default=None,
                        help="torch CPU threads, or 'auto': the cores idle now")


def run_command(args: argparse.Namespace) -> int:
    apply_threads(args.threads)
    model = GPT.from_config(args.preset, seed=0, dtype=DTYPES[args.dtype])
    print(f"profile: {args.preset} {args.dtype} batch {args.batch}, {args.prompt_tokens} cached "
          f"tokens, {torch.get_num_threads()} thread(s), torch {torch.__version__}")
    for name in args.engines:
        p = profile_decode(name, args.preset, args.dtype, args.batch,
                           prompt_tokens=args.prompt_tokens, steps=args.steps, rows=args.rows,
                           model=model)
        print(p.table)
        print(format_summary(p))
        sys.stdout.flush()
    return 0

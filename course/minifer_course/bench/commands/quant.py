"""``python -m minifer_course.bench quant``: bytes and decode tokens/s per precision
(`minifer_course.bench.quant` measures)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..common import loadavg, machine_info
from ..quant import QUICK_VARIANTS, VARIANTS, format_report, run
from . import add_machine_options, set_up_machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="gpt2",
                        help="model preset (default: gpt2, GPT-2 124M's shape)")
    parser.add_argument("--full", action="store_true",
                        help="every variant (fp16, the dequantize-then-matmul paths) at batch 1 "
                        "and 32; default: fp32, bf16, int8 and int4 fused at batch 1")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="decode batch sizes (default: 1; --full: 1 32)")
    parser.add_argument("--context", type=int, default=64,
                        help="cached tokens per sequence (default: 64)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="round-robin rounds of 3 steps per variant (default: 5)")
    parser.add_argument("--group-size", type=int, default=128, help="int4 group (default: 128)")
    add_machine_options(parser, device=False)
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the rows as JSON to PATH")


def run_command(args: argparse.Namespace) -> int:
    set_up_machine(args)
    batches = ([1, 32] if args.full else [1]) if args.batches is None else args.batches
    variants = VARIANTS if args.full else QUICK_VARIANTS
    load = loadavg()
    print(f"{args.preset} decode per precision, {torch.get_num_threads()} threads, "
          f"context {args.context}, torch {torch.__version__}, load average {load}")
    rows = run(args.preset, tuple(batches), args.context, args.rounds, variants=variants,
               group_size=args.group_size)
    print(format_report(rows))
    print(f"load average after: {loadavg()}")
    if args.json:
        out = {"command": "python -m minifer_course.bench " + " ".join(sys.argv[1:]),
               "machine": machine_info(), "preset": args.preset, "context": args.context,
               "loadavg_before": load, "loadavg_after": loadavg(),
               "rows": [{"label": r.label, "total_bytes": r.total_bytes,
                         "linear_bytes": r.linear_bytes,
                         "ms_per_step": r.ms_per_step,
                         "tokens_per_s": r.batch_tokens_per_s} for r in rows]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0

"""``python -m minifer_course.bench gpu``: the course's GPU claims measured on this machine's GPU
(`minifer_course.bench.gpu` measures; the JSON and a log go to ``--out`` as each part is measured)."""

from __future__ import annotations

import argparse

import torch

from ..gpu import FULL, QUICK, format_report, run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default=None,
                        help="torch device (default: cuda where a GPU is visible, else cpu)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes, seconds on a CPU (the default off CUDA)")
    parser.add_argument("--out", default=None,
                        help="folder for gpu-bench.json and gpu-bench.log, written as the run "
                        "goes (default: print only)")
    parser.add_argument("--budget-s", type=float, default=300.0,
                        help="seconds after which the compiled steps (the last part) stop "
                        "(default 300)")


def run_command(args: argparse.Namespace) -> int:
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    plan = QUICK if args.quick or not device.startswith("cuda") else FULL
    result = run(device, plan=plan, out_dir=args.out, budget_s=args.budget_s)
    print()
    print(format_report(result))
    return 0

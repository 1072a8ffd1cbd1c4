"""``python -m minifer_course.bench threads``: decode speed per thread count and OpenMP wait policy, on
the quiet machine and beside busy cores (`minifer_course.bench.threads` measures)."""

from __future__ import annotations

import argparse
import json
import os

import torch

from ..common import loadavg, machine_info
from ..threads import default_settings, format_report, run


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="reference", help="model shape (default: reference)")
    parser.add_argument("--batch", type=int, default=1, help="sequences decoded together (default 1)")
    parser.add_argument("--new-tokens", type=int, default=64,
                        help="tokens generated per timed run (default 64)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds; each runs every setting once per load (default 5)")
    parser.add_argument("--busy-cores", type=int, nargs="+", default=[0, 1],
                        help="background loads to run beside, in busy cores (default: 0 1)")
    parser.add_argument("--no-passive", action="store_true",
                        help="leave out the OMP_WAIT_POLICY=passive settings")
    parser.add_argument("--json", help="also write the rows to this JSON file")


def run_command(args: argparse.Namespace) -> int:
    settings = [s for s in default_settings() if not (args.no_passive and s.wait)]
    info = machine_info()
    print(f"{args.preset} greedy decode, batch {args.batch}, {args.new_tokens} tokens, "
          f"{args.rounds} rounds, settings alternating in fresh processes; {info['cpu']}, "
          f"{os.cpu_count()} CPUs, torch {torch.__version__}, load average {loadavg()}")
    rows = run(settings, rounds=args.rounds, busy_cores=tuple(args.busy_cores),
               preset=args.preset, batch=args.batch, new_tokens=args.new_tokens)
    print(format_report(rows))
    print(f"load average after: {loadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": info, "rows": [
                {"threads": r.setting.threads, "wait": r.setting.wait, "busy_cores": r.busy_cores,
                 "rates": r.rates, "threads_used": r.threads_used} for r in rows]}, f, indent=1)
    return 0




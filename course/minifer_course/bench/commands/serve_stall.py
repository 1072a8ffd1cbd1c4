"""``python -m minifer_course.bench serve-stall``: the largest gap in other clients' streams while ~1 MB
prompts arrive (`minifer_course.bench.serve_stall`); the server runs as ``python -m minifer.serve``."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..serve_stall import format_report, measure_stall, serve


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="shakespeare", help="the model the server loads")
    parser.add_argument("--streams", type=int, default=3, help="clients streaming meanwhile")
    parser.add_argument("--big", type=int, nargs="+", default=[1, 3],
                        help="how many big prompts arrive at once (one run each)")
    parser.add_argument("--chars", type=int, default=1_000_000, help="each big prompt's size")
    parser.add_argument("--threads", default=None,
                        help="the server's engine threads (default: its own, 'auto')")
    parser.add_argument("--json", type=Path, default=None, help="write the results as JSON")


def run_command(args: argparse.Namespace) -> int:
    extra = ["--threads", str(args.threads)] if args.threads else []
    results = []
    with serve(args.model, *extra) as url:
        for big in args.big:
            results.append(measure_stall(url, model=args.model, streams=args.streams, big=big,
                                         chars=args.chars))
    print(f"{args.streams} streams; cpus {os.cpu_count()}; load average "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(format_report(results))
    if args.json is not None:
        args.json.write_text(json.dumps([r.to_json() for r in results], indent=1))
        print(f"wrote {args.json}")
    return 0

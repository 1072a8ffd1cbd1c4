"""``python -m minifer_course.bench serve-vllm``: minifer's server beside vLLM's CPU build, both
measured by vLLM's own client (`minifer_course.bench.serve_vllm`). vLLM runs from a virtual
environment of its own (``--vllm``; that module's docstring says how to set one up)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from ..common import loadavg, machine_info
from ..serve_vllm import (
    DEFAULT_VLLM,
    format_report,
    run,
    summarize,
    vllm_problem,
    vllm_version,
)

PROG = "python -m minifer_course.bench serve-vllm"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    where = parser.add_mutually_exclusive_group()
    where.add_argument("--vllm", default=None, metavar="PATH",
                       help=f"vLLM's executable in its own environment (default: {DEFAULT_VLLM})")
    where.add_argument("--vllm-python", default=None, metavar="PATH",
                       help="that environment's python instead: its bin/vllm is run")
    parser.add_argument("--rounds", type=_positive, default=3,
                        help="rounds; the engines alternate (default 3)")
    parser.add_argument("--num-prompts", type=_positive, default=100,
                        help="requests per measured run, all sent at once (default 100)")
    parser.add_argument("--input-len", type=_positive, default=64,
                        help="random prompt tokens (default 64)")
    parser.add_argument("--output-len", type=_positive, default=64,
                        help="new tokens per request, --ignore-eos (default 64)")
    parser.add_argument("--max-num-seqs", type=_positive, default=32,
                        help="each server's --max-num-seqs (default 32)")
    parser.add_argument("--busy-cores", type=int, default=0, metavar="N",
                        help="keep N cores busy with another process while the client measures "
                             "(default 0: a quiet machine)")
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write every round and the medians as JSON to PATH")


def _positive(text: str) -> int:
    n = int(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text}")
    return n


def vllm_path(args: argparse.Namespace) -> str:
    """The vllm executable the options name."""
    if args.vllm_python:
        return str(Path(args.vllm_python).parent / "vllm")
    return args.vllm or DEFAULT_VLLM


def run_command(args: argparse.Namespace) -> int:
    vllm = vllm_path(args)
    if problem := vllm_problem(vllm):
        sys.exit(f"{PROG}: error: {problem}")
    if args.busy_cores < 0:
        sys.exit(f"{PROG}: error: --busy-cores must be 0 or more")
    version = vllm_version(vllm)
    load = loadavg()
    print(f"{args.num_prompts} requests at once of {args.input_len} random tokens + "
          f"{args.output_len} new (--ignore-eos), measured by vLLM {version}'s client "
          f"(vllm bench serve --backend vllm); fp32; --max-num-seqs {args.max_num_seqs}; "
          f"{args.rounds} round(s), engines alternating, each server started fresh; "
          f"{os.cpu_count()} CPUs, load average {load}"
          + (f"; {args.busy_cores} core(s) kept busy by another process while measuring"
             if args.busy_cores else ""), flush=True)
    try:
        measures = run(vllm, rounds=args.rounds, num_prompts=args.num_prompts,
                       input_len=args.input_len, output_len=args.output_len,
                       max_num_seqs=args.max_num_seqs, busy_cores=args.busy_cores)
    except (RuntimeError, ValueError) as e:  # a server or the client failed; both are stopped
        sys.exit(f"{PROG}: error: {e}")
    summary = summarize(measures)
    print(format_report(summary, version))
    after = loadavg()
    print(f"load average after: {after}")
    if args.json:
        out = {"command": "python -m minifer_course.bench " + " ".join(sys.argv[1:]),
               "machine": machine_info(), "vllm": version, "vllm_path": vllm,
               "loadavg_before": load, "loadavg_after": after, "busy_cores": args.busy_cores,
               "num_prompts": args.num_prompts, "input_len": args.input_len,
               "output_len": args.output_len, "max_num_seqs": args.max_num_seqs,
               "rounds": [m.to_json() for m in measures], "summary": summary}
        args.json.write_text(json.dumps(out, indent=1))
        print(f"wrote {args.json}")
    return 0

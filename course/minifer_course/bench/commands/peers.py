"""``python -m minifer_course.bench peers``: minifer beside CTranslate2 and OpenVINO GenAI on the same
weights (`minifer_course.bench.peers` measures). Needs the optional ``peers`` extra: each peer that is
not installed is skipped with a message, and without any of them the command says so and
succeeds (it is part of ``make bench``, which must run without the extra)."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from ..common import loadavg, machine_info
from ..peers import (
    PEERS,
    PRECISIONS,
    check_interpreter,
    format_report,
    peer_problems,
    peer_versions,
    peers_problem,
    run,
)
from . import add_machine_options, set_up_machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="gpt2",
                        help="model preset, random weights (default: gpt2, GPT-2 124M's shape)")
    parser.add_argument("--precisions", nargs="+", default=["fp32", "int8"],
                        choices=list(PRECISIONS),
                        help="precisions (default: fp32 int8; bf16 runs the peers that offer "
                             "it on this CPU)")
    parser.add_argument("--peers", nargs="+", default=None, choices=list(PEERS),
                        help="peer engines (default: every one that is installed)")
    parser.add_argument("--full", action="store_true",
                        help="batches 1 16 64 and 5 rounds (default: batches 1 16, 3 rounds)")
    parser.add_argument("--batches", type=int, nargs="+", default=None,
                        help="batch sizes (default: 1 16; --full: 1 16 64)")
    parser.add_argument("--prompt-len", type=int, default=32, help="prompt tokens (default 32)")
    parser.add_argument("--new-tokens", type=int, default=32, help="new tokens (default 32)")
    parser.add_argument("--rounds", type=int, default=None,
                        help="rounds in which the engines alternate (default 3; --full: 5)")
    add_machine_options(parser, device=False)
    parser.add_argument("--busy-cores", type=int, default=0, metavar="N",
                        help="keep N cores busy with another process while the rounds are "
                             "timed (default 0: a quiet machine)")
    parser.add_argument("--compiled", action="store_true",
                        help="also run minifer's default model of each precision with "
                             "compile=True (torch.compile's step; compiling adds ~15-30 s per "
                             "batch size to the warm-up)")
    parser.add_argument("--auto-threads", action="store_true",
                        help="also run each minifer engine with generate(..., threads='auto'): "
                             "a governor sets its threads from the cores other programs leave "
                             "free")
    parser.add_argument("--same-process", action="store_true",
                        help="run every engine in this one process (default: each in a process "
                             "of its own; engines sharing a process share its OpenMP runtimes "
                             "and can slow each other)")
    parser.add_argument("--peer-python", type=_peer_python, action="append", default=[],
                        metavar="PEER=PATH",
                        help="run PEER's process with the interpreter PATH, e.g. "
                             "openvino=/work/ov-venv/bin/python: a virtual environment holding "
                             "a peer that cannot be installed beside minifer (repeatable; "
                             "minifer_course.bench.peers's docstring says how to set one up)")
    parser.add_argument("--json", metavar="PATH", default=None,
                        help="also write the rows as JSON to PATH")


def _peer_python(text: str) -> tuple[str, str]:
    """``--peer-python PEER=PATH`` -> (peer, absolute path), checked (`check_interpreter`)."""
    peer, sep, path = text.partition("=")
    if not sep or not path:
        raise argparse.ArgumentTypeError(f"expected PEER=PATH (PEER one of {', '.join(PEERS)}), "
                                         f"got {text!r}")
    try:
        return peer, check_interpreter(peer, path)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def run_command(args: argparse.Namespace) -> int:
    pythons = dict(args.peer_python)
    if len(pythons) < len(args.peer_python):
        sys.exit("python -m minifer_course.bench peers: error: --peer-python names a peer twice")
    if pythons and args.same_process:
        sys.exit("python -m minifer_course.bench peers: error: --peer-python runs a peer in a process "
                 "of its own; it cannot be combined with --same-process")
    if problem := peers_problem(pythons):
        print(f"python -m minifer_course.bench peers: skipped: {problem}", file=sys.stderr)
        return 0
    problems = peer_problems(pythons)
    if args.peers and all(problems[p] is not None for p in args.peers):
        print("python -m minifer_course.bench peers: skipped: "
              + "; ".join(f"{p} {problems[p]}" for p in args.peers), file=sys.stderr)
        return 0
    set_up_machine(args)
    versions = peer_versions(pythons)
    load = loadavg()
    print(f"{args.preset} (random weights), prompt {args.prompt_len} + {args.new_tokens} new "
          f"tokens, greedy, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"load average {load}"
          + (f"; {args.busy_cores} core(s) kept busy by another process while timing"
             if args.busy_cores else "")
          + ("; every engine in this one process" if args.same_process
             else "; each engine in a process of its own"))
    print("peers: " + "; ".join(versions.values()))
    batches = args.batches or ([1, 16, 64] if args.full else [1, 16])
    rounds = args.rounds or (5 if args.full else 3)
    rows = run(args.preset, tuple(args.precisions), tuple(batches), args.prompt_len,
               args.new_tokens, rounds, threads=torch.get_num_threads(),
               peers=tuple(args.peers) if args.peers else None, busy_cores=args.busy_cores,
               compiled=args.compiled, isolate=not args.same_process,
               auto_threads=args.auto_threads, peer_python=pythons)
    print(format_report(rows))
    print(f"load average after: {loadavg()}")
    if args.json:
        out = {"command": "python -m minifer_course.bench " + " ".join(sys.argv[1:]),
               "machine": machine_info(), "peers": versions, "loadavg_before": load, "loadavg_after": loadavg(),
               "busy_cores": args.busy_cores, "same_process": args.same_process,
               "peer_python": pythons,
               "rows": [{"precision": r.precision, "batch": r.batch,
                         "tokens_per_s": r.tokens_per_s, "spread": r.spread,
                         "agreement": r.agreement,
                         "rounds_s": r.rounds, "ratio": r.ratio} for r in rows]}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0


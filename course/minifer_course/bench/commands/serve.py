"""``python -m minifer_course.bench serve``: static against continuous batching, and prefix caching
(`minifer_course.bench.serve` measures); ``serve --offline``: the saturating long-tailed load, all
requests at t=0 (`minifer_course.bench.serve_offline` measures), optionally engine against engine
(``--compare-roots``: checkouts run alternately in subprocesses)."""

from __future__ import annotations

import argparse
import sys

import torch

from ..serve import format_report, run
from . import add_machine_options, set_up_machine


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--full", action="store_true",
                        help="both models, 64 + 24 requests; default: a short run on the "
                        "shipped Shakespeare target, 32 + 12 requests")
    parser.add_argument("--models", nargs="+", default=None,
                        help="presets with random weights, or 'shakespeare' for the shipped "
                        "target (default: shakespeare; --full: reference shakespeare)")
    parser.add_argument("--requests", type=int, default=None,
                        help="requests in the mixed workload (default: 32; --full: 64)")
    parser.add_argument("--rate", type=float, default=16.0,
                        help="Poisson arrival rate, requests/s (default: 16; inf: all at once)")
    parser.add_argument("--prefix-requests", type=int, default=None,
                        help="requests sharing the system prompt (default: 12; --full: 24)")
    parser.add_argument("--system-prompt", type=int, default=200,
                        help="shared system prompt tokens (default: 200)")
    parser.add_argument("--max-num-seqs", type=int, default=16,
                        help="requests running at once; the static group size (default: 16)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size (default: 16)")
    parser.add_argument("--seed", type=int, default=0, help="workload seed (default: 0)")
    parser.add_argument("--repeats", type=int, default=2,
                        help="runs per variant, alternating; the fastest is kept (default: 2)")
    offline = parser.add_argument_group("offline long-tailed load (--offline)")
    offline.add_argument("--offline", action="store_true",
                         help="128 requests at t=0, prompts 16-64, outputs 80%% 8-32 / 20%% "
                         "128-192, greedy, ignore_eos: static vs continuous, medians")
    offline.add_argument("--rounds", type=int, default=5,
                         help="alternating rounds per policy (default: 5)")
    offline.add_argument("--compare-roots", nargs="+", default=None, metavar="LABEL=PATH",
                         help="engine checkouts to run alternately in subprocesses "
                         "(PYTHONPATH=PATH), e.g. old=/tmp/old new=.")
    http = parser.add_argument_group("the standard load over HTTP, server against server (--http)")
    http.add_argument("--http", action="store_true",
                      help="start `python -m minifer.serve` per variant and round (fresh "
                      "process), send the standard load (64-token prompts, 64 output tokens, "
                      "ignore_eos, streaming), alternating variants")
    http.add_argument("--server-threads", nargs="+", default=None, metavar="N|auto|default",
                      help="one variant per --threads value of the server; 'default' passes none "
                      "(the server's own default, auto) (default: default)")
    http.add_argument("--server-engines", nargs="+", default=None,
                      choices=("default", "thread", "process"),
                      help="one variant per --engine-in of the server: the engine in a thread "
                      "of the server's process or in a process of its own (default: the "
                      "server's default; a checkout whose server has no --engine-in runs once)")
    http.add_argument("--server-replicas", nargs="+", type=int, default=None, metavar="N",
                      help="one variant per --engine-replicas of the server (engine processes "
                      "sharing the seats; default: the server's default; a checkout whose "
                      "server has no --engine-replicas runs once)")
    http.add_argument("--rates", type=float, nargs="+", default=[float("inf")],
                      help="arrival rates, requests/s (default: inf)")
    http.add_argument("--busy-cores", type=int, nargs="+", default=[0],
                      help="background loads, in busy cores (default: 0; e.g. 0 1)")
    http.add_argument("--http-requests", type=int, default=100,
                      help="requests per run (default: 100)")
    http.add_argument("--http-rounds", type=int, default=3, help="rounds (default: 3)")
    add_machine_options(parser)


def run_command(args: argparse.Namespace) -> int:
    set_up_machine(args)
    if args.http:
        return _run_http(args)
    if args.offline:
        return _run_offline(args)
    full = args.full
    if args.models is None:
        args.models = ["reference", "shakespeare"] if full else ["shakespeare"]
    if args.requests is None:
        args.requests = 64 if full else 32
    if args.prefix_requests is None:
        args.prefix_requests = 24 if full else 12
    reports = run(args.models, requests=args.requests, rate=args.rate,
                  prefix_requests=args.prefix_requests, system_prompt=args.system_prompt,
                  max_num_seqs=args.max_num_seqs, block_size=args.block_size, seed=args.seed,
                  repeats=args.repeats, device=args.device)
    header = (f"serve: {args.requests} requests at {args.rate:g}/s, max_num_seqs="
              f"{args.max_num_seqs}, block {args.block_size}, chunked prefill (256 tokens/step),"
              f" {args.device}, {torch.get_num_threads()} threads, fastest of {args.repeats} "
              f"alternating runs")
    print(format_report(reports, header))
    return 0


def _run_offline(args: argparse.Namespace) -> int:
    from ..common import loadavg
    from ..serve_offline import compare_policies_offline, compare_roots, format_offline

    model = (args.models or ["shakespeare"])[0]
    requests = args.requests or 128
    kw = dict(rounds=args.rounds, requests=requests, max_num_seqs=args.max_num_seqs,
              seed=args.seed)
    before = loadavg()
    if args.compare_roots:
        roots = dict(r.split("=", 1) if "=" in r else (r, r) for r in args.compare_roots)
        runs = compare_roots(roots, model, threads=torch.get_num_threads(), **kw,
                             on_run=lambda r: print(f"  {r.engine} {r.policy}: "
                                                    f"{r.tokens_per_s:.0f} tok/s, wall "
                                                    f"{r.wall_s:.1f}s, forward {r.forward_s:.1f}s",
                                                    file=sys.stderr, flush=True))
    else:
        runs = compare_policies_offline(model, **kw)
    header = (f"serve --offline: {model}, {requests} requests at t=0, max_num_seqs="
              f"{args.max_num_seqs}, {torch.get_num_threads()} threads, medians of "
              f"{args.rounds} alternating rounds; load average {before} before, {loadavg()} "
              f"after")
    print(format_offline(runs, header))
    return 0


def _run_http(args: argparse.Namespace) -> int:
    from ..common import loadavg, machine_info
    from ..serve_http import Variant, compare, format_http, server_takes

    roots = (dict(r.split("=", 1) if "=" in r else (r, r) for r in args.compare_roots)
             if args.compare_roots else {"minifer": None})
    threads = args.server_threads or ["default"]
    variants = []
    for label, root in roots.items():
        engines = [None if e == "default" else e for e in args.server_engines or ["default"]]
        if not server_takes(root, "--engine-in"):  # an older checkout: its own default only
            engines = [None]
        replicas = args.server_replicas or [None]
        if not server_takes(root, "--engine-replicas"):
            replicas = [None]
        for t in threads:
            value = None if t == "default" else (t if t == "auto" else int(t))
            for where in engines:
                for n in replicas:
                    name = label + (f" threads={t}" if len(threads) > 1 else "") \
                        + (f" engine in {where or 'default'}" if len(engines) > 1 else "") \
                        + (f" replicas={n}" if len(replicas) > 1 else "")
                    variants.append(Variant(name, root, value, where, n))
    model = (args.models or ["shakespeare"])[0]
    info, before = machine_info(), loadavg()

    def progress(i, row, s):
        print(f"  round {i + 1}: {row.variant.label}, {row.busy_cores} busy, rate "
              f"{row.rate:g}: {s['output_throughput']:.0f} tok/s, TTFT mean "
              f"{s['ttft']['mean']:.2f} s", file=sys.stderr, flush=True)

    rows = compare(variants, rates=tuple(args.rates), busy_cores=tuple(args.busy_cores),
                   rounds=args.http_rounds, num_requests=args.http_requests, model=model,
                   max_num_seqs=args.max_num_seqs, seed=args.seed, on_run=progress)
    print(format_http(rows, f"serve --http: {model}, {args.http_requests} requests of 64 + 64 "
                      f"tokens, max_num_seqs={args.max_num_seqs}, {args.http_rounds} "
                      f"alternating rounds; {info['cpu']}, {info['cpus']} CPUs, torch "
                      f"{info['torch']}; load average {before} before, {loadavg()} after"))
    return 0

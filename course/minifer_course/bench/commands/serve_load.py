"""``python -m minifer_course.bench serve-load``: load-test an OpenAI-compatible completions server
(`minifer_course.bench.serve_load` sends the requests)."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from ..serve_load import format_report, make_requests, parse_slo, run_load


def _lengths(text: str):
    lo, _, hi = text.partition(",")
    return int(lo) if not hi else (int(lo), int(hi))


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--url", default="http://127.0.0.1:8000", help="the server's base URL")
    parser.add_argument("--model", default=None, help="model name (default: the server's first)")
    parser.add_argument("--api-key", default=os.environ.get("MINIFER_API_KEY"),
                        help="the server's API key, sent as a Bearer token "
                        "(default: $MINIFER_API_KEY)")
    parser.add_argument("--rate", type=float, default=4.0,
                        help="requests/s, Poisson arrivals (inf: all at once)")
    parser.add_argument("--num-requests", type=int, default=50)
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="most requests in flight at once (default: no cap)")
    parser.add_argument("--prompt-len", type=_lengths, default=(16, 64),
                        help="prompt tokens: N or LO,HI (uniform) (default 16,64)")
    parser.add_argument("--output-len", type=_lengths, default=(16, 64),
                        help="output tokens: N or LO,HI (uniform) (default 16,64)")
    parser.add_argument("--prompt-format", choices=["text", "ids"], default="text")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", action="store_true",
                        help="let requests stop at end-of-sequence (default: exact lengths)")
    parser.add_argument("--slo", type=parse_slo, default=None,
                        help="goodput targets, e.g. ttft=0.5,tpot=0.05 (seconds) or ttft=500ms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON")


def run_command(args: argparse.Namespace) -> int:
    requests = make_requests(args.num_requests, args.rate, prompt_len=args.prompt_len,
                             output_len=args.output_len, seed=args.seed,
                             prompt_format=args.prompt_format)
    result = run_load(args.url, requests, model=args.model, max_concurrency=args.max_concurrency,
                      slo=args.slo, temperature=args.temperature,
                      ignore_eos=not args.no_ignore_eos, api_key=args.api_key)
    print(format_report(result, args.rate))
    if args.out is not None:
        out = {"config": {k: (str(v) if isinstance(v, Path) else v)
                          for k, v in vars(args).items() if k not in ("func", "api_key")},
               **result.to_json()}
        args.out.write_text(json.dumps(out, indent=1, default=str))
        print(f"wrote {args.out}")
    return 0 if not result.errors else 1

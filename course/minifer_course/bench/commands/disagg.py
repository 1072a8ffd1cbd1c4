"""``python -m minifer_course.bench disagg``: colocated vs chunked vs disaggregated prefill under a
mixed load, and what moving a prompt's K/V costs on real links (`minifer_course.bench.disagg`
measures, `minifer_course.roofline.kv_transfer` computes)."""

from __future__ import annotations

import argparse
import json
import sys

from ...roofline import kv_transfer
from ..common import loadavg, machine_info
from ..disagg import MODES, compare, format_report, mixed_load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="shakespeare",
                        help="the shipped 'shakespeare' target or a preset with random weights "
                        "(default: shakespeare)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--chats", type=int, default=4, help="short chats (default 4)")
    parser.add_argument("--chat-tokens", type=int, default=None,
                        help="tokens each chat streams (default 64; --full: 192)")
    parser.add_argument("--long-prompts", type=int, default=None,
                        help="long prompts arriving while the chats stream (default 3; --full: 5)")
    parser.add_argument("--long-prompt", type=int, default=224,
                        help="tokens of each long prompt (default 224)")
    parser.add_argument("--period", type=float, default=0.3,
                        help="seconds between long prompts (default 0.3)")
    parser.add_argument("--chunk", type=int, default=32,
                        help="chunked mode's token budget per step (default 32)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process, the same in every mode (default 1)")
    parser.add_argument("--full", action="store_true",
                        help="5 long prompts and chats of 192 tokens (default: 3 and 64)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", default=None, help="also write JSON to PATH")


def run_command(args: argparse.Namespace) -> int:
    import minifer as mf

    if args.model == "shakespeare":
        model, _tok = mf.load_pretrained("shakespeare")
    else:
        model = mf.GPT.from_config(args.model, seed=0)
    if args.chat_tokens is None:
        args.chat_tokens = 192 if args.full else 64
    if args.long_prompts is None:
        args.long_prompts = 5 if args.full else 3
    load = mixed_load(model.config.vocab_size, chats=args.chats, chat_tokens=args.chat_tokens,
                      long_prompts=args.long_prompts, long_prompt=args.long_prompt,
                      period_s=args.period, seed=args.seed)
    before = loadavg()
    print(f"{args.model}: {args.chats} chats x {args.chat_tokens} tokens, {args.long_prompts} "
          f"prompts of {args.long_prompt} tokens every {args.period:g} s; {args.threads} torch "
          f"thread(s) per process; load average {before}", flush=True)
    results = compare(model, load, modes=args.modes, chunk=args.chunk, threads=args.threads)
    print(format_report(results))
    print("(ITL and max gap: the chats' token gaps once long prompts arrive; greedy tokens "
          "identical in every mode)")
    dis = results.get("disaggregated")
    if dis is not None:
        assert dis.kv_bytes == dis.bytes_per_token * dis.prompt_tokens
        print(f"K/V moved: {dis.kv_bytes:,} B = {dis.bytes_per_token:,} B/token x "
              f"{dis.prompt_tokens} prompt tokens")
    print("\nOne prompt's K/V on real links (roofline, 16-bit, latency + bytes / bandwidth):")
    for link in ("nvlink-h100", "pcie-5", "ethernet-400g", "ethernet-100g"):
        t = kv_transfer("llama-3-8b", 4096, link)
        print(f"  Llama-3-8B, 4,096 tokens, {t.nbytes / 2**20:,.0f} MiB over {t.interconnect}: "
              f"{t.ms:.1f} ms")
    after = loadavg()
    print(f"load average after: {after}")
    if args.json:
        out = {"command": "python -m minifer_course.bench " + " ".join(sys.argv[1:]),
               "machine": machine_info(), "loadavg_before": before, "loadavg_after": after,
               "modes": {m: {"itl_p50_s": r.itl("p50"), "itl_p99_s": r.itl("p99"),
                             "max_gap_s": r.itl("max"), "ttft_chat_s": r.ttft("chat"),
                             "ttft_long_s": r.ttft("long"), "kv_bytes": r.kv_bytes,
                             "transfer_s": r.transfer_s} for m, r in results.items()}}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
        print(f"wrote {args.json}")
    return 0

"""``torchrun --nproc-per-node 2 -m minifer.distributed.disagg --model shakespeare --prompt "ROMEO:"``

Both ranks' program (`worker`): under `torchrun` the prompts come from ``--prompt`` and rank 1
prints each completion; `DisaggregatedEngine` starts it with ``--front`` (requests on rank 0's
stdin, results on rank 1's stdout)."""

from __future__ import annotations

import argparse
import os
import sys

from ..parallel.__main__ import DTYPES, add_model_options


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minifer.distributed.disagg", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a rank waits for the other in a send or recv before failing")
    p.add_argument("--front", action="store_true", help=argparse.SUPPRESS)  # stdin/stdout lines
    p.add_argument("--keepalive", type=float, default=None,
                   help="seconds between rank 0's keep-alive messages while idle (default: "
                        "a quarter of --timeout, at most 10)")
    p.add_argument("--prompt", action="append", default=None,
                   help="a text prompt (repeat for several; needs a tokenizer)")
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-tokens", type=int, default=128,
                   help="rank 0's token budget per step (prompts batched or chunked to it)")
    p.add_argument("--prefill-max-seqs", type=int, default=8)
    p.add_argument("--decode-blocks", type=int, default=None,
                   help="blocks in rank 1's pool (default: room for --decode-max-seqs contexts)")
    p.add_argument("--decode-max-seqs", type=int, default=32)
    p.add_argument("--decode-tokens", type=int, default=None,
                   help="rank 1's token budget per step (default: the context length)")
    p.add_argument("--prefill-nice", type=int, default=0,
                   help="rank 0 lowers its CPU priority by this much (os.nice), so that on one "
                        "machine the decode steps run first")
    p.add_argument("--vocab", type=int, default=None,
                   help="sample among the first VOCAB ids (the tokenizer's size)")
    return p.parse_args(argv)


class Printer:
    """What rank 1 prints under torchrun: each completion, then a summary line per rank."""

    def __init__(self, tokenizer) -> None:
        self.tok = tokenizer

    def write(self, obj: dict) -> None:
        if obj["event"] == "finished":
            ids = obj["token_ids"]
            text = self.tok.decode(obj["prompt_ids"] + ids) if self.tok is not None else str(ids)
            print(f"[{obj['request_id']}] {text}  ({obj['kv_bytes']:,} KV bytes received, "
                  f"{obj['preemptions']} preemptions)", flush=True)
        elif obj["event"] == "report":
            busy = sum(s["end"] - s["start"] for s in obj["timeline"])
            moved = sum(s["nbytes"] for s in obj.get("recv", []))
            print(f"rank {obj['rank']} ({obj['role']}): {obj['steps']} steps, {busy * 1e3:.1f} ms "
                  f"busy" + (f", {moved:,} KV bytes received" if obj["role"] == "decode" else ""),
                  flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)

    import torch

    from ...engine.llm_engine import LLMEngine
    from ..handoff import params_to_dict
    from ..parallel.__main__ import join_group, load_model
    from ..parallel.runtime import leave_group, watch_parent
    from .worker import DECODE, PREFILL, Lines, ListRequests, StdinRequests, run_decode, run_prefill

    watch_parent()
    lines = Lines() if args.front else None
    comm, rank, world = join_group(args)
    done = False
    try:
        if world != 2:
            raise ValueError(f"disaggregated serving runs on 2 ranks (prefill, decode), got "
                             f"WORLD_SIZE={world}")
        model, tok = load_model(args.model, args.init_seed)
        model = model.to(device=comm.device, dtype=getattr(torch, DTYPES[args.dtype]))
        lines = Printer(tok) if lines is None else lines
        vocab = args.vocab if args.vocab is not None else (tok.vocab_size if tok else None)
        if rank == PREFILL:
            if args.prefill_nice:
                os.nice(args.prefill_nice)
            engine = LLMEngine(model, enable_chunked_prefill=True, block_size=args.block_size,
                               max_num_batched_tokens=args.prefill_tokens,
                               max_num_seqs=args.prefill_max_seqs, sample_vocab=vocab)
            if args.front:
                source = StdinRequests()
            else:
                if tok is None or not args.prompt:
                    raise ValueError("give --prompt (and a model with a tokenizer) under torchrun")
                from ...sampling import SamplingParams
                from ...tokenizer import encode_prompt

                params = params_to_dict(SamplingParams(
                    temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                    seed=args.seed, ignore_eos=args.ignore_eos))
                source = ListRequests([{"op": "add", "request_id": f"req-{i}",
                                        "prompt_ids": encode_prompt(tok, p), "params": params}
                                       for i, p in enumerate(args.prompt)])
            report = run_prefill(engine, source, comm.device, dst=DECODE,
                                 keepalive_s=args.keepalive or min(10.0, args.timeout / 4))
        else:
            engine = LLMEngine(model, enable_chunked_prefill=True, block_size=args.block_size,
                               num_blocks=args.decode_blocks, max_num_seqs=args.decode_max_seqs,
                               max_num_batched_tokens=args.decode_tokens or
                               model.config.context_length, sample_vocab=vocab)
            report = run_decode(engine, lines, comm.device, src=PREFILL)
        lines.write({"event": "report", "rank": rank, **report})
        done = True
    finally:
        leave_group(done)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``torchrun --nproc-per-node N -m minifer.distributed.parallel --model shakespeare --prompt "..."``

Every rank joins the group, loads the full model, keeps its slice and generates in lockstep;
rank 0 prints the text and the accounting. `run_local` starts the same program from Python."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The options every multi-process program of minifer shares (this one and
    ``minifer.distributed.disagg``): which model, its dtype, and where each rank runs."""
    p.add_argument("--model", default="shakespeare",
                   help="a shipped model (shakespeare), a GPTConfig preset with random weights "
                        "(tiny, tiny-gqa, reference, ...), or a checkpoint .safetensors path")
    p.add_argument("--init-seed", type=int, default=0, help="weights seed for preset models")
    p.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    p.add_argument("--device", choices=["auto", "cpu"], default="auto",
                   help="auto: cuda:LOCAL_RANK with NCCL when CUDA is present, else the CPU "
                        "with gloo; cpu: always the CPU with gloo")
    p.add_argument("--threads", type=int, default=None, help="torch threads per rank")


def join_group(args: argparse.Namespace):
    """Set this rank's torch threads and join the process group as the options of
    :func:`add_model_options` (and ``--timeout``) say; ``(comm, rank, world_size)``."""
    import torch

    from .runtime import init_group

    if args.threads:
        torch.set_num_threads(args.threads)
    return init_group(device="cpu" if args.device == "cpu" else None, timeout_s=args.timeout)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m minifer.distributed.parallel", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_options(p)
    p.add_argument("--prompt", default="ROMEO:", help="text prompt (needs a tokenizer)")
    p.add_argument("--request", help=argparse.SUPPRESS)  # JSON {prompts: [[ids]], ...} from run_local
    p.add_argument("--max-new-tokens", type=int, default=40)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None, help="sampling seed (rank 0 samples)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--allow-uneven", action="store_true",
                   help="split heads unevenly when they do not divide the world size")
    p.add_argument("--keep-logits", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--report", help="write each rank's report as JSON; '{rank}' in the path is "
                                    "replaced by the rank")
    p.add_argument("--timeout", type=float, default=120.0,
                   help="seconds a rank waits for the others before giving up")
    return p.parse_args(argv)


def load_model(name: str, init_seed: int = 0):
    """``(GPT, tokenizer or None)`` from a shipped name, a preset name or a checkpoint path."""
    from ...config import PRESETS
    from ...model import GPT
    from ...pretrained import PRETRAINED, load_checkpoint, load_pretrained
    from ...tokenizer import ByteTokenizer

    if name in PRETRAINED:
        return load_pretrained(name)
    if name in PRESETS:
        model = GPT.from_config(name, seed=init_seed)
        tok = ByteTokenizer() if model.config.vocab_size >= ByteTokenizer().vocab_size else None
        return model, tok
    if name.endswith(".safetensors"):
        return load_checkpoint(name)[0], None
    raise ValueError(f"--model must be one of {sorted(PRETRAINED)}, a preset {sorted(PRESETS)} "
                     f"or a .safetensors checkpoint, got {name!r}")


def run_rank(args: argparse.Namespace) -> dict:
    import torch
    import torch.distributed as dist

    from ...sampling import SamplingParams
    from ..handoff import params_from_dict
    from .runtime import generate_tp, leave_group, shard_for_rank

    comm, rank, world = join_group(args)
    done = False
    try:
        model, tok = load_model(args.model, args.init_seed)
        model = model.to(dtype=getattr(torch, DTYPES[args.dtype]))
        if args.request:
            req = json.loads(Path(args.request).read_text())
            prompts, params = req["prompts"], params_from_dict(req["params"])
        else:
            if tok is None:
                raise ValueError(f"model {args.model!r} has no tokenizer; give a shipped model")
            from ...tokenizer import encode_prompt

            prompts = [encode_prompt(tok, args.prompt)]  # a checkpoint's BOS first
            params = SamplingParams(max_new_tokens=args.max_new_tokens,
                                    temperature=args.temperature, top_k=args.top_k,
                                    top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)
        eos = tok.eos_token_id if tok is not None and tok.eos_token_id is not None \
            else model.config.eos_token_id
        model, plan = shard_for_rank(model, comm, rank, world, allow_uneven=args.allow_uneven)
        report = generate_tp(model, plan, comm, prompts, params, eos_token_id=eos,
                             vocab=tok.vocab_size if tok is not None else None,
                             keep_logits=args.keep_logits).to_dict()
        if args.report:
            Path(args.report.replace("{rank}", str(rank))).write_text(json.dumps(report))
        everyone = [None] * world
        dist.all_gather_object(everyone, {k: v for k, v in report.items() if k != "logits"})
        if rank == 0:
            _print_summary(everyone, prompts, tok)
        done = True
        return report
    finally:
        leave_group(done)


def _print_summary(reports: list[dict], prompts, tok) -> None:
    r0 = reports[0]
    for b, ids in enumerate(r0["token_ids"]):
        text = tok.decode(prompts[b] + ids) if tok is not None else str(ids)
        print(f"[row {b}] {text}")
    print(f"\n{'rank':>4} {'heads':>7} {'weights MB':>11} {'KV MB':>8} {'AR/step':>8} "
          f"{'AR KB/step':>11} {'compute ms/step':>16} {'comm ms/step':>13}")
    for r in reports:
        steps = max(r["decode_steps"], 1)
        print(f"{r['rank']:>4} {r['q_heads'][0]:>3}-{r['q_heads'][1] - 1:<3} "
              f"{r['weight_bytes']['total'] / 1e6:>11.2f} {r['kv_bytes'] / 1e6:>8.3f} "
              f"{r['allreduce_calls_per_step']:>8} {r['allreduce_bytes_per_step'] / 1e3:>11.1f} "
              f"{(r['decode_s'] - r['decode_comm_s']) / steps * 1e3:>16.2f} "
              f"{r['decode_comm_s'] / steps * 1e3:>13.2f}")


def main(argv: list[str] | None = None) -> int:
    from .runtime import watch_parent

    args = parse_args(argv)
    watch_parent()
    run_rank(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())

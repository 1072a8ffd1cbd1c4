"""``python -m minifer.serve --model shakespeare``: the OpenAI-compatible server from a shell.

Serves on http://127.0.0.1:8000 by default (loopback only; ``--host 0.0.0.0`` exposes it to
your network, deliberately). Try it::

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 32, "temperature": 0}'
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m minifer.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shakespeare",
                   help="a shipped model (shakespeare, shakespeare-draft) or a GPTConfig preset "
                        "with random weights and the byte tokenizer (tiny, reference)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cpu, cuda, mps (default: the best present)")
    e = p.add_argument_group("engine (vLLM's option names)")
    e.add_argument("--policy", choices=["continuous", "static"], default="continuous")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-blocks", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=32)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--enable-chunked-prefill", action="store_true")
    e.add_argument("--enable-prefix-caching", action="store_true")
    e.add_argument("--aging", type=float, default=0.0,
                   help="priority points a waiting request gains per step (0: strict priority)")
    lim = p.add_argument_group("limits (claim MET-5)")
    lim.add_argument("--max-model-len", type=int, default=None,
                     help="most prompt + max_tokens - 1 per request (default: what fits)")
    lim.add_argument("--max-tokens", type=int, default=None,
                     help="most output tokens a request may ask for")
    lim.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    lim.add_argument("--max-waiting", type=int, default=64,
                     help="requests that may wait for their first step; more get 429")
    p.add_argument("--log-level", default="info")
    return p


def load_model(name: str, device=None):
    """A shipped model with its tokenizer, or a preset with random weights and bytes."""
    import minifer as mf
    from minifer.pretrained import PRETRAINED

    if name in PRETRAINED:
        return mf.load_pretrained(name, device=device)
    if name in mf.PRESETS:
        return mf.GPT.from_config(name, seed=0).to(device or "cpu").eval(), mf.ByteTokenizer()
    raise SystemExit(f"--model must be one of {sorted(PRETRAINED)} or a preset "
                     f"{sorted(mf.PRESETS)}, got {name!r}")


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    import uvicorn

    import minifer as mf

    from .api import create_app
    from .engine import LLMEngine

    device = args.device or str(mf.default_device())
    model, tok = load_model(args.model, device)
    engine = LLMEngine(model, tok, policy=args.policy, block_size=args.block_size,
                       num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       enable_chunked_prefill=args.enable_chunked_prefill,
                       enable_prefix_caching=args.enable_prefix_caching, aging=args.aging)
    app = create_app(engine, model_name=args.served_model_name or args.model,
                     max_model_len=args.max_model_len, max_tokens=args.max_tokens,
                     request_timeout_s=args.request_timeout, max_waiting=args.max_waiting)
    if args.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"minifer: warning: --host {args.host} makes the server reachable from other "
              "machines, and it has no authentication", file=sys.stderr)
    print(f"minifer: serving {args.model!r} ({engine!r}) on http://{args.host}:{args.port}",
          file=sys.stderr)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


if __name__ == "__main__":
    sys.exit(main())

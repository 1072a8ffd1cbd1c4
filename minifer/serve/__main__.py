"""``python -m minifer.serve --model shakespeare``: the OpenAI-compatible server from a shell.

Serves on http://127.0.0.1:8000 (loopback; ``--host 0.0.0.0``, with an ``--api-key``). Try::

    curl http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"model": "shakespeare", "prompt": "ROMEO:", "max_tokens": 32, "temperature": 0}'
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"model": "shakespeare", "messages": [{"role": "user", "content": "Art thou well?"}]}'

With ``--api-key KEY`` (or ``$MINIFER_API_KEY``) every route but ``/health`` needs
``Authorization: Bearer KEY``, as OpenAI's clients send it."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from ..checks import parse_threads

API_KEY_ENV = "MINIFER_API_KEY"


def build_parser() -> argparse.ArgumentParser:
    """The command line (the defaults are `create_app`'s and `LLMEngine`'s)."""
    from ..distributed.engine_process import ENGINES

    p = argparse.ArgumentParser(prog="python -m minifer.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="shakespeare",
                   help="a shipped model (shakespeare, shakespeare-draft), a GPTConfig preset "
                        "with random weights and the byte tokenizer (tiny, reference), or a "
                        "Hugging Face checkpoint folder (Llama, Qwen2, Qwen3, GPT-2)")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as `model` (default: --model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default: loopback)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--device", default=None, help="cpu, cuda, mps (default: the best present)")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="the weights' dtype (default: a checkpoint's stored one)")
    p.add_argument("--quantization", choices=("int8", "int4", "bf16"), default=None,
                   help="serve quantized weights (minifer.quantize)")
    sec = p.add_argument_group("security")
    sec.add_argument("--api-key", default=None,
                     help=f"require 'Authorization: Bearer KEY' on every route but /health "
                          f"(default: ${API_KEY_ENV}, else no key)")
    sec.add_argument("--allowed-hosts", nargs="+", default=None, metavar="NAME",
                     help="Host header names to answer ('*': any; default: the loopback names "
                          "when bound to loopback, any otherwise)")
    _engine_options(p.add_argument_group("engine (vLLM's option names)"))
    _limit_options(p.add_argument_group("limits (claim MET-5)"))
    p.add_argument("--threads", type=parse_threads, default="auto",
                   help="torch CPU threads for the engine's steps, or 'auto' (the default): "
                        "the cores other programs leave free, followed as they change")
    p.add_argument("--engine-in", choices=ENGINES, default="process",
                   help="where the engine steps: 'process' (default: a process of its own; a "
                        "thread where it cannot start) or 'thread' (the server's process)")
    p.add_argument("--engine-replicas", type=int, default=1, metavar="N",
                   help="engine processes, each with its share of --max-num-seqs and of the "
                        "KV pool (vLLM: --data-parallel-size)")
    p.add_argument("--log-level", default="info")
    return p


def _engine_options(e) -> None:
    from ..engine.config import MAX_SPECULATIVE_TOKENS
    from .api import SCHEDULING_POLICIES

    e.add_argument("--policy", choices=["continuous", "static"], default="continuous")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks (default: --max-num-seqs requests of --max-model-len tokens, "
                        "within --kv-cache-memory)")
    e.add_argument("--kv-cache-memory", type=memory_size, default=None, metavar="BYTES|FRACTION",
                   help="the KV pool's memory: bytes (8GiB, 512MiB, 1e9) or a fraction of the "
                        "memory available at start (0.25); default 0.5")
    e.add_argument("--max-num-seqs", type=int, default=32)
    e.add_argument("--max-num-batched-tokens", type=int, default=None)
    e.add_argument("--enable-chunked-prefill", action="store_true")
    e.add_argument("--enable-prefix-caching", action="store_true")
    e.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs: first come, first served (a request's priority is refused); "
                        "priority: lower priority value first")
    e.add_argument("--aging", type=float, default=0.0,
                   help="priority points a waiting request gains per step (0: strict priority)")
    e.add_argument("--draft-model", default=None, metavar="NAME",
                   help="speculative decoding: a small model with --model's tokenizer drafts "
                        "tokens that --model checks (loaded as --model is: shakespeare-draft)")
    e.add_argument("--num-speculative-tokens", type=int, default=None, metavar="K",
                   choices=range(1, MAX_SPECULATIVE_TOKENS + 1),
                   help="tokens the draft proposes per request and step (1 to 16, default 4)")


def _limit_options(lim) -> None:
    from ..chat_template import MAX_TEMPLATE_CHARS, TEMPLATE_TIMEOUT_S
    from ..engine.async_engine import DEFAULT_MAX_WAITING
    from .api import MAX_CONNECTIONS, MAX_HEADER_BYTES, READ_TIMEOUT_S, SHUTDOWN_GRACE_S

    lim.add_argument("--max-model-len", type=int, default=None,
                     help="most prompt + max_tokens - 1 per request (default: what fits)")
    lim.add_argument("--max-tokens", type=int, default=None,
                     help="most output tokens a request may ask for")
    lim.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    lim.add_argument("--max-waiting", type=int, default=DEFAULT_MAX_WAITING,
                     help="requests that may wait for their first token; more get 429 with "
                          "Retry-After")
    lim.add_argument("--read-timeout", type=float, default=READ_TIMEOUT_S,
                     help="seconds for a request's headers, and then its body, to arrive")
    lim.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS,
                     help="connections at once; more get 503")
    lim.add_argument("--max-header-bytes", type=int, default=MAX_HEADER_BYTES,
                     help="largest request headers (431 past it)")
    lim.add_argument("--chat-template-timeout", type=float, default=TEMPLATE_TIMEOUT_S,
                     help="seconds a chat template may take to render (past it: killed, a 400)")
    lim.add_argument("--chat-template-max-chars", type=int, default=MAX_TEMPLATE_CHARS,
                     help="most characters (or list items) a chat template may build or render")
    lim.add_argument("--shutdown-grace", type=float, default=SHUTDOWN_GRACE_S,
                     help="on SIGTERM or Ctrl-C, seconds the requests in flight have to "
                          "finish; then each open stream gets an error event and [DONE]")


def memory_size(text: str) -> int | float:
    """``--kv-cache-memory``: bytes (``4GiB``, ``512MiB``, ``4e9``) or a fraction (``0.25``)."""
    scale = {"gib": 2**30, "mib": 2**20}.get(text.strip().lower()[-3:], 1)
    try:
        value = float(text.strip()[:-3] if scale > 1 else text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected bytes (4GiB, 512MiB, 4e9) or a fraction "
                                         f"(0.25), got {text!r}") from None
    return value if scale == 1 and 0 < value <= 1 else int(value * scale)


def api_key(flag: str | None) -> str | None:
    """The key from ``--api-key``, else ``$MINIFER_API_KEY``, else None; a blank key is a
    ValueError (``--api-key "$UNSET"`` must not turn authentication off)."""
    for where, key in (("--api-key", flag), (f"${API_KEY_ENV}", os.environ.get(API_KEY_ENV))):
        if key is None:
            continue
        if not key.strip():
            raise ValueError(f"{where} is empty: give a key, or leave it out (unset "
                             f"${API_KEY_ENV}) to serve without one")
        return key
    return None


def server_options(args: argparse.Namespace) -> dict:
    """`create_app`'s options from the command line (ValueError for an empty API key)."""
    from .api import LOOPBACK_HOSTS

    hosts = args.allowed_hosts if args.allowed_hosts is not None else (
        list(LOOPBACK_HOSTS) if args.host in LOOPBACK_HOSTS else None)
    return dict(max_model_len=args.max_model_len, max_tokens=args.max_tokens,
                request_timeout_s=args.request_timeout, max_waiting=args.max_waiting,
                api_key=api_key(args.api_key),
                allowed_hosts=hosts, scheduling_policy=args.scheduling_policy,
                read_timeout_s=args.read_timeout, max_header_bytes=args.max_header_bytes,
                threads=args.threads, engine_in=args.engine_in, replicas=args.engine_replicas,
                chat_template_timeout_s=args.chat_template_timeout,
                chat_template_max_chars=args.chat_template_max_chars)


def load_model(name: str, device=None, dtype=None, flag: str = "--model"):
    """A shipped model with its tokenizer, a preset with random weights and bytes, or a Hugging
    Face checkpoint folder (`minifer.load_hf_checkpoint`: its tokenizer and chat template)."""
    import torch

    import minifer as mf
    from minifer.hf_checkpoint import is_hub_id
    from minifer.pretrained import PRETRAINED

    if name in PRETRAINED:
        return mf.load_pretrained(name, device=device, dtype=dtype)
    if name in mf.PRESETS:
        model = mf.GPT.from_config(name, seed=0).to(device or "cpu", dtype or torch.float32)
        return model.eval(), mf.ByteTokenizer()
    if os.path.isdir(name) or is_hub_id(name):  # a hub id: from the local cache, else downloaded
        return mf.load_hf_checkpoint(name, device=device, dtype=dtype)
    raise SystemExit(f"{flag} must be one of {sorted(PRETRAINED)}, a preset "
                     f"{sorted(mf.PRESETS)}, a checkpoint folder or a hub id (org/name), got "
                     f"{name!r}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        options = server_options(args)
    except ValueError as err:
        parser.error(str(err))  # exits 2 with the usage, before anything is loaded

    import torch

    import minifer as mf

    from ..engine.llm_engine import LLMEngine
    from ..speculative import check_tokenizers
    from .api import LOOPBACK_HOSTS, create_app, make_server, server_config

    device, dtype = args.device or str(mf.default_device()), getattr(torch, args.dtype or "", None)
    model, tok = load_model(args.model, device, dtype)
    if args.quantization is not None:
        model = mf.quantize(model, args.quantization)
    draft = None
    if args.draft_model is not None:  # speculative decoding: the same tokenizer, or refused
        draft, draft_tok = load_model(args.draft_model, device, dtype, "--draft-model")
        check_tokenizers(tok, draft_tok)
    engine = LLMEngine(model, tok, draft_model=draft, **{name: getattr(args, name) for name in (
        "policy", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens", "aging",
        "enable_chunked_prefill", "enable_prefix_caching", "max_model_len", "kv_cache_memory",
        "num_speculative_tokens")})  # EngineConfig's fields, as the flags name them
    app = create_app(engine, model_name=args.served_model_name or args.model,
                     model_root=args.model, **options)
    if options["api_key"] is None and args.host not in LOOPBACK_HOSTS:
        print(f"minifer: warning: --host {args.host} makes the server reachable from other "
              f"machines, and it has no API key (--api-key or ${API_KEY_ENV})", file=sys.stderr)
    print(f"minifer: serving {args.model!r} ({engine!r}) on http://{args.host}:{args.port}"
          f"{' (API key required)' if options['api_key'] else ''}", file=sys.stderr)
    c, pool = engine.config, engine.pool
    print(f"minifer: KV pool: {c.num_blocks:,} blocks of {c.block_size} tokens = "
          f"{c.num_blocks * c.block_size:,} tokens, {pool.nbytes / 2**30:.2f} GiB "
          f"(max_model_len {c.max_model_len:,}; --kv-cache-memory, --max-model-len)",
          file=sys.stderr)
    make_server(server_config(app, max_connections=args.max_connections,
                              log_level=args.log_level, host=args.host, port=args.port,
                              shutdown_grace_s=args.shutdown_grace)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())

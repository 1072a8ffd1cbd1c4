"""Your engine: the pieces the lessons have you write, assembled into one serving engine.

A reference copy, as you would have written it, one file per step of the course (lesson 14
runs it whole; a lesson can import it as "the engine so far"):

| file | lesson | what it holds |
|---|---|---|
| `loop.py` | 01 | the generation loop: a forward pass per token, greedy, and its stop conditions |
| `model.py` | 02, 03, 07 | the forward pass over a KV cache: attention in plain torch ops, rotary positions, the padded batch and its mask |
| `sampler.py` | 06 | temperature, top-k, top-p, the repetition penalty, a seeded draw |
| `paging.py` | 08 | KV blocks, the free list, block tables |
| `engine.py` | 08 | the scheduler (admit, decode, preempt) and one step that runs every piece |
| `int8.py` | 09 | int8 weights per output row, `Int8Linear`, every linear layer swapped |
| `speculative.py` | 10 | draft, verify, accept, roll back |
| `server.py` | 11 | an HTTP endpoint streaming server-sent events, and a client that loads it |

It takes from minifer only the model (its weights and layers, `mf.load_pretrained` or
`mf.load_hf_checkpoint`), the tokenizer and `SamplingParams`; the mechanism is all here, and
minifer is what its tokens are checked against.
"""

from .engine import Engine, Output, Request
from .int8 import Int8Linear, int8_per_row, quantized, swap_linears
from .loop import generate_until, greedy_loop, next_token
from .model import Cache, KVPool, Row, decode_step, feed, forward, greedy_cached, prefill
from .paging import Allocator
from .sampler import draw, my_sampler, pick
from .server import complete, load, read_events, serve
from .speculative import greedy_verify, my_speculative, propose

FILES = {"loop": "01", "model": "02, 03, 07", "sampler": "06", "paging": "08", "engine": "08",
         "int8": "09", "speculative": "10", "server": "11"}
"""Each file of the engine and the lessons its pieces come from, in the course's order."""

__all__ = ["FILES", "Allocator", "Cache", "Engine", "Int8Linear", "KVPool", "Output", "Request",
           "Row", "complete", "decode_step", "draw", "feed", "forward", "generate_until",
           "greedy_cached", "greedy_loop", "greedy_verify", "int8_per_row", "load",
           "my_sampler", "my_speculative", "next_token", "pick", "prefill", "propose",
           "quantized", "read_events", "serve", "swap_linears"]

"""minifer: a small, honest PyTorch inference engine for learning how LLM inference works.

The engine (this package's top-level modules) imports only torch and the tokenizer libraries;
the figures and sliders of the course live in `minifer.lessons`.
"""

from .cache import StaticKVCache
from .config import PRESETS, GPTConfig
from .generate import (
    Completion,
    TextStopper,
    TokenEvent,
    decode_step,
    default_device,
    generate,
    prefill,
    stream,
)
from .evaluate import perplexity
from .model import GPT
from .pretrained import load_pretrained
from .sampling import SamplingParams
from .tokenizer import ByteTokenizer, Tokenizer

__all__ = [
    "GPT",
    "PRESETS",
    "ByteTokenizer",
    "Completion",
    "GPTConfig",
    "SamplingParams",
    "StaticKVCache",
    "TextStopper",
    "TokenEvent",
    "Tokenizer",
    "decode_step",
    "default_device",
    "generate",
    "load_pretrained",
    "perplexity",
    "prefill",
    "stream",
]
__version__ = "0.1.0"

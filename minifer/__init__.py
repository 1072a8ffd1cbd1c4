"""minifer: a small, honest PyTorch inference engine for learning how LLM inference works.

The core (this package's top-level modules) imports only torch and the tokenizer libraries; the
serving engine (`minifer.engine`), the engine in processes of its own (`minifer.distributed`)
and the HTTP server (`minifer.serve`) stand on it, each floor importing only those below. The
CPU speed-ups live apart in `minifer.fast`, plugged in below at one seam (`minifer.hooks`);
``MINIFER_SPEEDUPS=0`` leaves them out, ``with minifer.fast.disabled():`` turns them off for a
block: the code that runs is then the code you read. The course's figures, calculators and
benchmarks are a package of their own (`minifer_course`, in the repository's course/)."""

# The speed-ups (minifer.fast) plug into the core here; MINIFER_SPEEDUPS=0 leaves them out.
from . import fast  # noqa: E402  (after the core it plugs into)
from .cache import StaticKVCache
from .chat_template import chat
from .config import PRESETS, GPTConfig
from .device import default_device
from .fast.prepack import prepack  # noqa: E402
from .generation import decode_step, generate, prefill, stream
from .hf_checkpoint import load_hf_checkpoint
from .model import GPT
from .pretrained import load_pretrained
from .quantization import model_bytes, quantization_summary, quantize
from .sampling import SamplingParams
from .sequence import Completion, Sequence, TextStopper, TokenEvent
from .speculative import PromptLookupDrafter, speculative_generate
from .tokenizer import ByteTokenizer, Tokenizer

fast.install()

__all__ = [
    "GPT", "PRESETS", "PromptLookupDrafter", "ByteTokenizer", "RequestOutput", "Completion",
    "GPTConfig", "LLMEngine", "SamplingParams", "Sequence", "StaticKVCache", "TextStopper",
    "TokenEvent", "Tokenizer", "chat", "decode_step", "default_device", "generate",
    "load_hf_checkpoint", "load_pretrained", "model_bytes", "prefill", "prepack", "quantize",
    "quantization_summary", "speculative_generate", "stream",
]
__version__ = "0.1.0"


def __getattr__(name: str):
    """`LLMEngine` and `RequestOutput` load on first use, so `import minifer` stays light."""
    if name in ("LLMEngine", "RequestOutput"):
        from .engine import llm_engine as engine

        return getattr(engine, name)
    raise AttributeError(f"module 'minifer' has no attribute {name!r}")

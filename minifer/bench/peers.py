"""minifer beside a CPU engine people pick instead: ``python -m minifer.bench peers``.

The same weights run in minifer and in CTranslate2 (the optional ``peers`` extra:
``pip install 'minifer[peers]'``): the model is exported to a `transformers` GPT-2 directory
(`baselines.to_hf`) with a stand-in tokenizer whose token ``i`` is the string ``"t<i>"``, so
token ids pass through unchanged, and converted with CTranslate2's own converter. Then, for each
precision and batch size:

* **agreement**: both engines decode the same random prompts greedily; the share of identical
  tokens is reported (fp32 should agree exactly; int8 engines round differently);
* **decode tokens/s**: each engine generates 1 and then ``new_tokens`` tokens from the same
  prompts; the difference of the two times is decode alone (the prompt's time subtracted), so
  ``batch × (new_tokens − 1) / (t_N − t_1)`` from the medians of both times over the rounds.
  The engines take turns in every round (a slow spell of the machine hits all of them), and
  the spread (max/min) of each engine's ``t_N`` over the rounds is reported: the figure that a
  busy machine moves.

Precisions: ``fp32`` (both float32), ``int8`` (CTranslate2 ``int8``, weights and activations
8-bit on integer GEMMs, against minifer's weight-only kernel and its W8A8 ``integer`` path).
CTranslate2 offers bf16 only where the CPU has it (`ctranslate2.get_supported_compute_types`).
"""

from __future__ import annotations

import importlib.util
import statistics
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..model import GPT

__all__ = ["PEERS_EXTRA", "peers_problem", "MiniferEngine", "CTranslate2Engine", "PeerRow",
           "agreement", "timed", "decode_rate", "run", "format_report"]

PEERS_EXTRA = "pip install 'minifer[peers]'"


def peers_problem() -> str | None:
    """Why the peer engines cannot run here (None: they can)."""
    missing = [m for m in ("ctranslate2", "transformers") if importlib.util.find_spec(m) is None]
    if missing:
        return f"needs {', '.join(missing)} (the optional peers extra: {PEERS_EXTRA})"
    return None


class MiniferEngine:
    """`minifer.generate`, greedy, past the end-of-sequence token."""

    def __init__(self, model: torch.nn.Module, name: str = "minifer") -> None:
        self.model, self.name = model, name

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from ..generation import generate
        from ..sampling import SamplingParams

        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
        return [c.token_ids for c in generate(self.model, prompts, params)]


def _export_hf(model: torch.nn.Module, folder: Path) -> Path:
    """`model` as a `transformers` directory with a tokenizer that maps id ``i`` to ``"t<i>"``."""
    import transformers
    from tokenizers import Tokenizer, models

    from .baselines import to_hf

    cfg = model.config
    special = f"t{cfg.eos_token_id}"
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        to_hf(model.float()).save_pretrained(folder)
        transformers.PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=special, eos_token=special, unk_token=special
        ).save_pretrained(folder)
    return folder


class CTranslate2Engine:
    """CTranslate2's `Generator` on the same weights, greedy (``sampling_topk=1``)."""

    def __init__(self, model: torch.nn.Module, compute_type: str = "float32",
                 threads: int | None = None, folder: Path | None = None) -> None:
        import ctranslate2

        if compute_type not in ctranslate2.get_supported_compute_types("cpu"):
            raise ValueError(f"compute_type {compute_type!r} is not supported by CTranslate2 on "
                             f"this CPU; it supports {sorted(ctranslate2.get_supported_compute_types('cpu'))}")
        self.name = f"ctranslate2 {compute_type}"
        self._tmp = None
        if folder is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="minifer-ct2-")
            folder = Path(self._tmp.name)
        hf = _export_hf(model, folder / "hf")
        out = folder / f"ct2-{compute_type}"
        ctranslate2.converters.TransformersConverter(str(hf)).convert(
            str(out), quantization=compute_type, force=True)
        self.generator = ctranslate2.Generator(
            str(out), device="cpu", compute_type=compute_type,
            intra_threads=threads or torch.get_num_threads())

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        results = self.generator.generate_batch(
            [[f"t{i}" for i in p] for p in prompts], max_length=new_tokens,
            min_length=new_tokens, sampling_topk=1, include_prompt_in_result=False)
        return [[int(t[1:]) for t in r.sequences[0]] for r in results]


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two batches of token lists hold the same token."""
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(max(len(ra), len(rb)) for ra, rb in zip(a, b))
    return same / total if total else 1.0


def timed(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for `engine` to generate `new_tokens` tokens from `prompts`."""
    t0 = time.perf_counter()
    engine.generate(prompts, new_tokens)
    return time.perf_counter() - t0


def decode_rate(batch: int, new_tokens: int, t_one: float, t_all: float) -> float:
    """Decode tokens/s from the time of 1 and of `new_tokens` new tokens: the difference is
    decode alone (both include the same prompt). NaN when noise hides the difference."""
    decode_s = t_all - t_one
    return batch * (new_tokens - 1) / decode_s if decode_s > 0 else float("nan")


@dataclass(frozen=True)
class PeerRow:
    precision: str
    batch: int
    tokens_per_s: dict[str, float]  # engine -> median decode tokens/s
    spread: dict[str, float]  # engine -> max/min of the rounds' times for new_tokens tokens
    agreement: dict[str, float] = field(default_factory=dict)  # engine -> share equal to minifer's

    @property
    def ratio(self) -> float:
        """The fastest minifer engine ÷ the fastest peer."""
        ours = max(v for k, v in self.tokens_per_s.items() if k.startswith("minifer"))
        peers = [v for k, v in self.tokens_per_s.items() if not k.startswith("minifer")]
        return ours / max(peers) if peers else float("nan")


def _engines(model: torch.nn.Module, precision: str, threads: int | None, folder: Path):
    from ..quantization import integer_problem, quantize

    if precision == "fp32":
        return [MiniferEngine(model), CTranslate2Engine(model, "float32", threads, folder)]
    if precision == "int8":
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ours = [MiniferEngine(quantize(model, "int8"), "minifer int8 weight-only")]
            if integer_problem() is None:
                ours.append(MiniferEngine(quantize(model, "int8", impl="integer"),
                                          "minifer int8 integer"))
        return ours + [CTranslate2Engine(model, "int8", threads, folder)]
    raise ValueError(f"precision must be 'fp32' or 'int8', got {precision!r}")


def run(preset: str = "gpt2", precisions: tuple[str, ...] = ("fp32", "int8"),
        batches: tuple[int, ...] = (1, 16), prompt_len: int = 32, new_tokens: int = 32,
        rounds: int = 3, threads: int | None = None, seed: int = 0,
        model: GPT | None = None) -> list[PeerRow]:
    """Every precision × batch: agreement with minifer's greedy tokens and decode tokens/s of
    each engine, the engines alternating within every round (one warm-up call each first).
    The model is `preset` with random weights (timings do not depend on them), or `model`."""
    if problem := peers_problem():
        raise RuntimeError(f"python -m minifer.bench peers {problem}")
    model = (GPT.from_config(preset, seed=seed) if model is None else model).eval()
    gen = torch.Generator().manual_seed(seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="minifer-peers-") as tmp:
        for precision in precisions:
            engines = _engines(model, precision, threads, Path(tmp))
            for batch in batches:
                prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                                        generator=gen).tolist()
                outs = {e.name: e.generate(prompts, new_tokens) for e in engines}  # warm-up
                first = outs[engines[0].name]
                agree = {k: agreement(first, v) for k, v in outs.items() if k != engines[0].name}
                ones: dict[str, list[float]] = {e.name: [] for e in engines}
                alls: dict[str, list[float]] = {e.name: [] for e in engines}
                for _ in range(rounds):
                    for e in engines:
                        ones[e.name].append(timed(e, prompts, 1))
                        alls[e.name].append(timed(e, prompts, new_tokens))
                rows.append(PeerRow(
                    precision, batch,
                    {k: decode_rate(batch, new_tokens, statistics.median(ones[k]),
                                    statistics.median(alls[k])) for k in alls},
                    {k: max(v) / min(v) for k, v in alls.items()}, agree))
    return rows


def format_report(rows: list[PeerRow]) -> str:
    lines = [f"{'precision':<10}{'batch':>6}  {'engine':<28}{'tok/s':>9}{'spread':>8}"
             f"{'agree':>7}"]
    for r in rows:
        for name, tps in r.tokens_per_s.items():
            agree = f"{r.agreement[name]:.2f}" if name in r.agreement else "-"
            lines.append(f"{r.precision:<10}{r.batch:>6}  {name:<28}{tps:>9.1f}"
                         f"{r.spread[name]:>8.2f}{agree:>7}")
        lines.append(f"{'':<16}minifer ÷ fastest peer: {r.ratio:.2f}")
    lines.append("decode tokens/s with the prompt's time subtracted (1 vs N new tokens); median "
                 "of rounds in which the engines alternate; spread = max/min over the rounds; "
                 "agree = share of greedy tokens equal to the first engine's (minifer).")
    return "\n".join(lines)

"""Synthetic serving workloads: who asks what, and when.

A serving benchmark needs requests that arrive over time, with prompt and output lengths that
vary, like real traffic. :func:`poisson_workload` makes them, seeded and reproducible:

* **arrivals** form a Poisson process at ``rate`` requests/s: the gaps between arrivals are
  independent exponential draws of mean ``1 / rate`` (``rate=math.inf``: everything arrives at
  0, an offline batch). ``burstiness`` ≠ 1 draws gamma gaps of the same mean instead (< 1
  burstier, > 1 more even), the option vLLM's benchmark offers;
* **lengths** of prompts and outputs come from seeded distributions: a fixed ``int``, a
  ``(lo, hi)`` range (uniform integers, both ends included), or :class:`Uniform` /
  :class:`LogNormal` (a long tail of long requests, as in real chat traffic);
* **prompts** are real text: a random window of the shipped corpus's held-out plays
  (:func:`minifer.pretrained.load_validation_text`) tokenized with the shipped tokenizer or the
  one given (``source="random"`` draws random token ids instead, for random-weight models);
* a **shared system prompt** (``system_prompt_len`` tokens, the same for every request) is put
  in front of each prompt: the workload that prefix caching speeds up.

Each of the four is drawn from its own random stream (derived from ``seed``), so changing one
knob leaves the others alone: the same seed at twice the rate gives the same prompts and
lengths, arriving exactly twice as fast — a load sweep compares like with like.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any

from minifer.checks import check_int, check_number

__all__ = ["Arrival", "Request", "Uniform", "LogNormal", "poisson_workload", "corpus_ids", "as_lengths",
           "SOURCES"]

SOURCES = ("shakespeare", "random")


@dataclass(frozen=True)
class Arrival:
    """One request of a workload as it arrives: what to send, how many tokens to ask for, and
    when. (Inside the serving engine a request is a `minifer.engine.request.Request`: a
    `Sequence` with a place in the scheduler.)"""

    prompt: list[int] | str
    max_new_tokens: int
    arrival_s: float  # seconds after the workload starts
    request_id: str = ""
    prefix_len: int = 0  # leading tokens shared with every other request (system prompt)

    @property
    def prompt_len(self) -> int:
        """Prompt length in tokens (characters if the prompt is text)."""
        return len(self.prompt)

    def params(self, **overrides: Any):
        """`SamplingParams` that produce exactly ``max_new_tokens`` tokens (greedy, EOS ignored,
        as serving benchmarks do); ``overrides`` replace any field."""
        from minifer.sampling import SamplingParams

        kw = dict(temperature=0.0, max_new_tokens=self.max_new_tokens, ignore_eos=True)
        kw.update(overrides)
        return SamplingParams(**kw)


Request = Arrival  # the older name, kept for code written against it


@dataclass(frozen=True)
class Uniform:
    """Integers from ``lo`` to ``hi``, both included, equally likely."""

    lo: int
    hi: int

    def __post_init__(self) -> None:
        check_int("lo", self.lo, 1)
        check_int("hi", self.hi, self.lo)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.lo, self.hi)


@dataclass(frozen=True)
class LogNormal:
    """Lengths whose logarithm is normal: median ``median``, spread ``sigma`` (of the log),
    rounded and clipped to ``[lo, hi]``. Most requests are short, a few are long."""

    median: float
    sigma: float
    lo: int
    hi: int

    def __post_init__(self) -> None:
        for name in ("median", "sigma"):
            v = getattr(self, name)
            check_number(name, v, gt=0)
        check_int("lo", self.lo, 1)
        check_int("hi", self.hi, self.lo)

    def sample(self, rng: random.Random) -> int:
        x = round(rng.lognormvariate(math.log(self.median), self.sigma))
        return min(max(x, self.lo), self.hi)


Lengths = int | tuple[int, int] | Uniform | LogNormal


def as_lengths(spec: Lengths, name: str = "lengths") -> Uniform | LogNormal:
    """A length distribution from an ``int`` (always that), a ``(lo, hi)`` range, or a
    :class:`Uniform` / :class:`LogNormal` (returned as is)."""
    if isinstance(spec, (Uniform, LogNormal)):
        return spec
    if isinstance(spec, int) and not isinstance(spec, bool):
        check_int(name, spec, 1)
        return Uniform(spec, spec)
    if isinstance(spec, tuple) and len(spec) == 2:
        lo, hi = spec
        check_int(f"{name}[0]", lo, 1)
        check_int(f"{name}[1]", hi, lo)
        return Uniform(lo, hi)
    raise TypeError(f"{name} must be an int, a (lo, hi) tuple, Uniform or LogNormal, "
                    f"got {spec!r}")


_CORPUS: dict[tuple[str, int], tuple[Any, list[int]]] = {}


def _default_tokenizer():
    from minifer.pretrained import model_files
    from minifer.tokenizer import Tokenizer

    return Tokenizer.from_file(model_files("shakespeare")[2])


def corpus_ids(tokenizer: Any = None, folder: str = "shakespeare") -> list[int]:
    """The held-out plays of the shipped corpus as token ids (``tokenizer``: default the
    shipped one). Tokenized once per tokenizer and kept (~83K ids with the shipped tokenizer)."""
    from minifer.pretrained import load_validation_text

    key = (folder, id(tokenizer))
    hit = _CORPUS.get(key)
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    tok = _default_tokenizer() if tokenizer is None else tokenizer
    ids = list(tok.encode(load_validation_text(folder)))
    if len(_CORPUS) > 8:
        _CORPUS.clear()
    _CORPUS[key] = (tokenizer, ids)
    return ids


def _gaps(rng: random.Random, n: int, rate: float, burstiness: float) -> list[float]:
    if math.isinf(rate):
        return [0.0] * n
    if burstiness == 1.0:
        return [rng.expovariate(rate) for _ in range(n)]
    return [rng.gammavariate(burstiness, 1.0 / (rate * burstiness)) for _ in range(n)]


def poisson_workload(n: int, rate: float, prompt_len: Lengths = (16, 64),
                     output_len: Lengths = (16, 64), *, seed: int = 0, tokenizer: Any = None,
                     source: str = "shakespeare", system_prompt_len: int = 0,
                     vocab_size: int | None = None, burstiness: float = 1.0,
                     first_at_zero: bool = True) -> list[Arrival]:
    """``n`` requests arriving as a Poisson process of ``rate`` requests/s, sorted by arrival.

    ``prompt_len`` and ``output_len`` (tokens) are length specs (see :func:`as_lengths`);
    ``prompt_len`` counts each request's own part, after the ``system_prompt_len`` shared
    tokens. ``source="shakespeare"`` cuts prompts from the held-out corpus text tokenized with
    ``tokenizer`` (default: the shipped tokenizer); ``source="random"`` draws uniform ids below
    ``vocab_size``. ``first_at_zero`` shifts the arrivals so the first request arrives at 0
    (the benchmark starts with work to do). Same arguments, same workload.
    """
    check_int("n", n, 1)
    check_number("rate", rate, gt=0, why=" of requests/s (math.inf: all at once)")
    check_number("burstiness", burstiness, gt=0, finite=True, why=" (1: Poisson)")
    check_int("seed", seed, 0)
    check_int("system_prompt_len", system_prompt_len, 0)
    if source not in SOURCES:
        raise ValueError(f"source must be one of {SOURCES}, got {source!r}")
    prompts = as_lengths(prompt_len, "prompt_len")
    outputs = as_lengths(output_len, "output_len")

    rng_arrive, rng_prompt_len, rng_output_len, rng_text = (
        random.Random(f"{seed}-{what}") for what in ("arrivals", "prompt_len", "output_len",
                                                     "text"))
    gaps = _gaps(rng_arrive, n, float(rate), float(burstiness))
    arrivals, t = [], 0.0
    for g in gaps:
        t += g
        arrivals.append(t)
    if first_at_zero:
        arrivals = [a - arrivals[0] for a in arrivals]
    p_lens = [prompts.sample(rng_prompt_len) for _ in range(n)]
    o_lens = [outputs.sample(rng_output_len) for _ in range(n)]

    if source == "random":
        if vocab_size is None:
            raise ValueError("source='random' needs vocab_size (ids are drawn below it)")
        check_int("vocab_size", vocab_size, 1)

        def window(length: int, rng: random.Random = rng_text) -> list[int]:
            return [rng.randrange(vocab_size) for _ in range(length)]
    else:
        ids = corpus_ids(tokenizer)
        longest = prompts.hi + system_prompt_len
        if longest > len(ids):
            raise ValueError(f"prompts of up to {longest} tokens do not fit in the corpus "
                             f"({len(ids)} tokens)")

        def window(length: int, rng: random.Random = rng_text) -> list[int]:
            start = rng.randrange(len(ids) - length + 1)
            return ids[start:start + length]

    # its own stream: the requests' own parts are the same with or without a system prompt
    system = window(system_prompt_len, random.Random(f"{seed}-system")) \
        if system_prompt_len else []
    return [Arrival(prompt=system + window(p), max_new_tokens=o, arrival_s=a,
                    request_id=f"req-{i}", prefix_len=system_prompt_len)
            for i, (a, p, o) in enumerate(zip(arrivals, p_lens, o_lens))]

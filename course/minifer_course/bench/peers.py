"""minifer beside the CPU engines people pick instead: ``python -m minifer_course.bench peers``.

The same weights run in minifer and in each peer engine that is installed (the optional
``peers`` extra: ``pip install 'minifer[peers]'``; a peer that is missing is skipped with a
message): CTranslate2 and OpenVINO GenAI. The model is exported to a `transformers` GPT-2
directory (`baselines.to_hf`) with a stand-in tokenizer whose token ``i`` is the string
``"t<i>"``, so token ids pass through unchanged. CTranslate2 converts that directory with its
own converter; for OpenVINO, optimum-intel exports it to the stateful OpenVINO IR (K/V cache
held inside the model as state) that ``openvino_genai.LLMPipeline`` runs, and the pipeline is
given token ids directly, so it needs no OpenVINO tokenizer. Then, for each precision and batch
size:

* **agreement**: every engine decodes the same random prompts greedily; the share of tokens
  identical to minifer's is reported (fp32 should agree exactly; bf16 and int8 engines round
  differently);
* **decode tokens/s**: each engine generates 1 and then ``new_tokens`` tokens from the same
  prompts; the difference of the two times is decode alone (the prompt's time subtracted), so
  ``batch × (new_tokens − 1) / (t_N − t_1)`` from the medians of both times over the rounds
  (no rate where the rounds' 1-token times spread further than that difference).
  The engines take turns in every round (a slow spell of the machine hits all of them), and
  the spread (max/min) of each engine's ``t_N`` over the rounds is reported: the figure that a
  busy machine moves. Each engine runs in a process of its own (`ProcessEngine`), as a user
  runs one engine: in one shared process, CTranslate2's OpenMP runtime beside torch's slowed
  minifer's fp32 decode by 30% once CTranslate2 had run (``--same-process`` shows it).

A peer's process can run another interpreter (``--peer-python PEER=PATH``, `run`'s
``peer_python``): OpenVINO GenAI's exporter cannot be installed beside minifer's torch, so it
lives in a virtual environment of its own, with the same torch and minifer's runtime
dependencies (minifer itself is imported from this checkout)::

    python3 -m venv /work/ov-venv
    /work/ov-venv/bin/pip install torch==2.13.0 openvino-genai 'optimum-intel[openvino]' \
        numpy safetensors tokenizers tqdm
    /work/ov-venv/bin/pip uninstall -y torchvision  # PyPI's build breaks beside a +cpu torch
    python -m minifer_course.bench peers --peers openvino --peer-python openvino=/work/ov-venv/bin/python

Precisions:

minifer runs as it is and, where oneDNN is present, with its linear weights prepacked
(`minifer.fast.prepack`: what the peers do with their weights at load; in bf16 as it is, since
``quantize(model, "bf16")`` prepacks where oneDNN packs bf16). Its engines
call `generate` with its default thread policy: ``--threads`` is a ceiling, lowered between
steps while other programs hold cores (``--auto-threads`` adds each with ``threads="auto"``);
the peers keep ``--threads`` fixed, as they are built to.

* ``fp32``: every engine in float32. OpenVINO's CPU plugin would otherwise compute in bf16 on
  CPUs with AVX512-BF16/AMX and keep the K/V cache in f16, so its inference precision hint and
  its K/V cache precision are both set to f32.
* ``bf16``: minifer's model cast to bf16; CTranslate2 ``bfloat16`` and OpenVINO's bf16
  inference precision (K/V cache in bf16 too), each only where the CPU has it
  (`ctranslate2.get_supported_compute_types`, OpenVINO's ``OPTIMIZATION_CAPABILITIES``).
* ``int8``: minifer's weight-only kernel, its W8A8 ``integer`` path, and ``quantize``'s default
  (``auto``: the faster of the two per layer shape, timed on this machine), against CTranslate2
  ``int8`` (weights and activations 8-bit on integer GEMMs) and OpenVINO int8 (see
  `OpenVINOEngine`: weights int8 from the export, activations quantized at run time).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import io
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch

from minifer.model import GPT

__all__ = ["PEERS_EXTRA", "PEERS", "PRECISIONS", "peer_problems", "available_peers",
           "peers_problem", "peer_versions", "check_interpreter", "MiniferEngine",
           "CTranslate2Engine", "OpenVINOEngine", "EngineSpec",
           "engine_specs", "build_engine", "ProcessEngine", "PeerRow",
           "agreement", "timed", "decode_rate", "run", "format_report"]

PEERS_EXTRA = "pip install 'minifer[peers]'"
PEERS = ("ctranslate2", "openvino")
PRECISIONS = ("fp32", "bf16", "int8")
# what each peer imports: its runtime, and what exports the model for it
_PEER_MODULES = {"ctranslate2": ("ctranslate2", "transformers"),
                 "openvino": ("openvino_genai", "optimum.intel", "transformers")}


def _missing(modules: tuple[str, ...]) -> list[str]:
    missing = []
    for name in modules:
        try:
            found = importlib.util.find_spec(name) is not None
        except ModuleNotFoundError:  # "optimum.intel" without "optimum"
            found = False
        if not found:
            missing.append(name)
    return missing


@functools.lru_cache(maxsize=1)
def _torchvision_problem() -> str | None:
    """A torchvision that cannot load breaks `transformers`' model imports, hence every export.

    optimum-intel requires torchvision, and the one pip picks from PyPI is built against PyPI's
    torch: beside a CPU-only torch build (``+cpu``) its operators fail to register."""
    if importlib.util.find_spec("torchvision") is None:
        return None
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any failure to load is the problem reported
        return (f"torchvision is installed but does not load with torch {torch.__version__} "
                f"({type(e).__name__}: {e}); uninstall it or install the build matching torch")
    return None


# the packages whose versions a report names for each peer
_PEER_PACKAGES = {"ctranslate2": ("ctranslate2",), "openvino": ("openvino-genai", "optimum-intel")}
_ROOT = str(Path(__file__).resolve().parents[3])  # this checkout: the children import minifer here
# what another interpreter is asked (`_ask`), printed as JSON on its last line
_PROBE = ("import json, sys; sys.path[:0] = [{root!r}, {root!r} + '/course']; "
          "from minifer_course.bench.peers import peer_problems, peer_versions; "
          "print(json.dumps({{'path': [p for p in sys.path if p], 'problems': peer_problems(), "
          "'versions': peer_versions()}}))")


def check_interpreter(peer: str, python: str) -> str:
    """`python` as the interpreter for `peer`'s process, its path made absolute (symlinks kept:
    a virtual environment's ``bin/python`` is one); ValueError for an unknown peer or a path
    that is not an executable file."""
    if peer not in PEERS:
        raise ValueError(f"unknown peer {peer!r}; choose from {PEERS}")
    if not (os.path.isfile(python) and os.access(python, os.X_OK)):
        raise ValueError(f"{peer}'s interpreter {python!r} is not an executable file")
    return os.path.abspath(python)


@functools.cache
def _ask(python: str) -> dict:
    """What the interpreter `python` says, importing minifer from this checkout: its
    `peer_problems`, its `peer_versions` and its sys.path (this checkout first), or
    ``{"error": why}`` where it cannot import minifer."""
    done = subprocess.run([python, "-c", _PROBE.format(root=_ROOT)], capture_output=True,
                          text=True, timeout=300)
    if done.returncode:
        last = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        return {"error": f"cannot import minifer from {_ROOT} in {python} ({last})"}
    return json.loads(done.stdout.strip().splitlines()[-1])


def peer_problems(pythons: dict[str, str] | None = None) -> dict[str, str | None]:
    """Each peer engine -> why it cannot run here (None: it can). A peer in `pythons` (peer ->
    interpreter) is judged by that interpreter, asked in a subprocess."""
    out: dict[str, str | None] = {}
    for peer, modules in _PEER_MODULES.items():
        if pythons and peer in pythons:
            answer = _ask(pythons[peer])
            problem = answer.get("error") or answer["problems"][peer]
            out[peer] = problem and f"{problem} (in {pythons[peer]})"
            continue
        missing = _missing(modules)
        out[peer] = (f"needs {', '.join(missing)} (the optional peers extra: {PEERS_EXTRA})"
                     if missing else _torchvision_problem())
    return out


def peer_versions(pythons: dict[str, str] | None = None) -> dict[str, str]:
    """Each peer engine -> the versions of the packages it runs on (a peer in `pythons`: those
    in its interpreter, named), or why it cannot run."""
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for peer, problem in peer_problems(pythons).items():
        if problem is not None:
            out[peer] = f"{peer} not run: {problem}"
            continue
        if pythons and peer in pythons:
            out[peer] = f"{_ask(pythons[peer])['versions'][peer]} (in {pythons[peer]})"
            continue
        try:
            out[peer] = " + ".join(f"{p} {version(p)}" for p in _PEER_PACKAGES[peer])
        except PackageNotFoundError:
            out[peer] = f"{peer} (version unknown)"
    return out


def available_peers(pythons: dict[str, str] | None = None) -> tuple[str, ...]:
    """The peer engines that can run here (`pythons`: as in `peer_problems`), in `PEERS` order."""
    return tuple(p for p, problem in peer_problems(pythons).items() if problem is None)


def peers_problem(pythons: dict[str, str] | None = None) -> str | None:
    """Why no peer engine can run here (None: at least one can; `peer_problems` says which)."""
    problems = peer_problems(pythons)
    if any(p is None for p in problems.values()):
        return None
    return "; ".join(f"{peer} {why}" for peer, why in problems.items())


class MiniferEngine:
    """`minifer.generate`, greedy, past the end-of-sequence token."""

    def __init__(self, model: torch.nn.Module, name: str = "minifer", compile: bool = False,
                 threads: int | str | None = None) -> None:
        self.model, self.name, self.compile, self.threads = model, name, compile, threads

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        from minifer.generation import generate
        from minifer.sampling import SamplingParams

        params = SamplingParams(temperature=0, max_new_tokens=new_tokens, ignore_eos=True)
        return [c.token_ids for c in generate(self.model, prompts, params,
                                              compile=self.compile, threads=self.threads)]


@contextlib.contextmanager
def _quiet():
    """The exporters' chatter off: progress bars, tracer warnings, NNCF's bit-width table and
    the PyTorch frontend's "Failed to build model wrapper." (an error it logs before tracing the
    model unwrapped, which works: the fp32 tests check the tokens). None of it is a result."""
    import transformers

    loggers = {name: logging.getLogger(name) for name in ("nncf", "openvino.frontend.pytorch")}
    levels = {name: log.level for name, log in loggers.items()}
    verbosity = transformers.logging.get_verbosity()
    bars = transformers.utils.logging.is_progress_bar_enabled()
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    for log in loggers.values():
        log.setLevel(logging.CRITICAL)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
            warnings.simplefilter("ignore")
            yield
    finally:
        transformers.logging.set_verbosity(verbosity)
        if bars:
            transformers.utils.logging.enable_progress_bar()
        for name, log in loggers.items():
            log.setLevel(levels[name])


def _export_hf(model: torch.nn.Module, folder: Path) -> Path:
    """`model` as a `transformers` directory with a tokenizer that maps id ``i`` to ``"t<i>"``."""
    import transformers
    from tokenizers import Tokenizer, models

    from .baselines import to_hf

    cfg = model.config
    special = f"t{cfg.eos_token_id}"
    vocab = {f"t{i}": i for i in range(cfg.vocab_size)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=special))
    with _quiet():
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
        with _quiet():
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


def _export_openvino(hf: Path, out: Path, int8: bool) -> Path:
    """The `transformers` directory `hf` as optimum-intel's stateful OpenVINO IR in `out`.

    ``load_in_8bit`` is passed either way: left unset, optimum-intel compresses models of more
    than a billion parameters to int8 on its own."""
    from optimum.intel import OVModelForCausalLM

    with _quiet():
        ov_model = OVModelForCausalLM.from_pretrained(str(hf), export=True, load_in_8bit=int8,
                                                      compile=False)
        ov_model.save_pretrained(out)
    return out


class OpenVINOEngine:
    """OpenVINO GenAI's `LLMPipeline` on the CPU, on the same weights, greedy past end-of-sequence.

    The pipeline takes token ids (a left-padded ``input_ids`` tensor and its ``attention_mask``)
    and returns token ids, so the exported directory holds no OpenVINO tokenizer. It runs with
    ``ATTENTION_BACKEND="SDPA"``: the stateful pipeline, which takes a batch as one tensor like
    the other engines here (the CPU's default, the paged-attention continuous-batching pipeline,
    refuses a batch of token ids in one tensor; it wants one request per prompt).

    Precisions, what is rounded where:

    * ``"fp32"``: weights float32 in the IR; ``INFERENCE_PRECISION_HINT`` f32 (the CPU plugin
      would compute in bf16 on CPUs with AVX512-BF16/AMX) and ``KV_CACHE_PRECISION`` f32 (its
      default is f16).
    * ``"bf16"``: the same float32 IR computed in bf16 (hint and K/V cache bf16), only where
      the CPU reports ``BF16`` among its optimization capabilities.
    * ``"int8"``: optimum-intel's ``load_in_8bit`` export runs NNCF's weight compression:
      *every* weight matrix, the token and position embeddings and the output head included,
      stored as uint8 with one scale and one zero point per output channel (``int8_asym``,
      data-free); biases and LayerNorms stay float32. The activations are not quantized by
      the export: at run time the CPU plugin quantizes each fully-connected layer's input to
      8 bits, one scale per group of 32 input values (``DYNAMIC_QUANTIZATION_GROUP_SIZE``,
      set to 32 here, the value the plugin picks by default in 2026.4; setting it to 0 changes
      the logits, so the rounding is real); everything else runs in f32 (hint f32, K/V cache
      f32). So it is W8A8 like CTranslate2's ``int8``, with finer activation scales, and it
      also rounds the embeddings, which minifer keeps in float.
    """

    def __init__(self, model: torch.nn.Module, precision: str = "fp32",
                 threads: int | None = None, folder: Path | None = None) -> None:
        import openvino
        import openvino_genai

        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        capabilities = openvino.Core().get_property("CPU", "OPTIMIZATION_CAPABILITIES")
        if precision == "bf16" and "BF16" not in capabilities:
            raise ValueError(f"OpenVINO's CPU plugin has no bf16 on this CPU; it offers "
                             f"{sorted(capabilities)}")
        self.name = f"openvino {precision}"
        self.eos_token_id = model.config.eos_token_id
        self._tmp = None
        if folder is None:
            self._tmp = tempfile.TemporaryDirectory(prefix="minifer-ov-")
            folder = Path(self._tmp.name)
        hf = _export_hf(model, folder / "hf")
        ir = _export_openvino(hf, folder / f"ov-{'int8' if precision == 'int8' else 'fp32'}",
                              int8=precision == "int8")
        compute = "bf16" if precision == "bf16" else "f32"
        properties: dict[str, object] = {
            "ATTENTION_BACKEND": "SDPA", "INFERENCE_PRECISION_HINT": compute,
            "KV_CACHE_PRECISION": compute,
            "INFERENCE_NUM_THREADS": threads or torch.get_num_threads()}
        if precision == "int8":
            properties["DYNAMIC_QUANTIZATION_GROUP_SIZE"] = 32
        self.pipeline = openvino_genai.LLMPipeline(str(ir), "CPU", **properties)

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        import numpy as np
        import openvino
        import openvino_genai

        width = max(len(p) for p in prompts)
        ids = np.array([[0] * (width - len(p)) + list(p) for p in prompts], dtype=np.int64)
        mask = np.array([[0] * (width - len(p)) + [1] * len(p) for p in prompts], dtype=np.int64)
        config = openvino_genai.GenerationConfig(
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, ignore_eos=True,
            do_sample=False, eos_token_id=self.eos_token_id)
        result = self.pipeline.generate(
            openvino_genai.TokenizedInputs(openvino.Tensor(ids), openvino.Tensor(mask)), config)
        tokens = [list(map(int, t)) for t in result.tokens]
        if len(tokens) != len(prompts) or any(len(t) != new_tokens for t in tokens):
            raise RuntimeError(f"OpenVINO returned {[len(t) for t in tokens]} tokens for "
                               f"{len(prompts)} prompts, {new_tokens} new tokens each")
        return tokens


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Share of positions where two batches of token lists hold the same token."""
    same = sum(x == y for ra, rb in zip(a, b) for x, y in zip(ra, rb))
    total = sum(max(len(ra), len(rb)) for ra, rb in zip(a, b))
    return same / total if total else 1.0


def timed(engine, prompts: list[list[int]], new_tokens: int) -> float:
    """Seconds for `engine` to generate `new_tokens` tokens from `prompts` (an engine in a
    process of its own times itself there: the pipe to it is not counted)."""
    t0 = time.perf_counter()
    engine.generate(prompts, new_tokens)
    return getattr(engine, "last_seconds", time.perf_counter() - t0)


def decode_rate(batch: int, new_tokens: int, t_one: float, t_all: float,
                noise: float = 0.0) -> float:
    """Decode tokens/s from the time of 1 and of `new_tokens` new tokens: the difference is
    decode alone (both include the same prompt). NaN when noise hides the difference: when it
    is no larger than `noise`, how far the 1-token times of the rounds spread (max − min).
    That happened to a compiled engine at batch 64 on a 2-core Xeon: its 1-token calls took
    1.1–2.9 s where the 32-token calls took 2.0–2.7, so the difference of the medians claimed
    9,700 tok/s (its process faulted in ~300,000 fresh pages per call; BENCHMARKS.md)."""
    decode_s = t_all - t_one
    return batch * (new_tokens - 1) / decode_s if decode_s > max(noise, 0.0) else float("nan")


@dataclass(frozen=True)
class PeerRow:
    precision: str
    batch: int
    tokens_per_s: dict[str, float]  # engine -> median decode tokens/s
    spread: dict[str, float]  # engine -> max/min of the rounds' times for new_tokens tokens
    agreement: dict[str, float] = field(default_factory=dict)  # engine -> share equal to minifer's
    # engine -> each round's seconds for 1 and for new_tokens tokens, in the order timed
    rounds: dict[str, list[tuple[float, float]]] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """The fastest minifer engine ÷ the fastest peer (a NaN rate, noise, is left out)."""
        rates = {k: v for k, v in self.tokens_per_s.items() if not math.isnan(v)}
        ours = [v for k, v in rates.items() if k.startswith("minifer")]
        peers = [v for k, v in rates.items() if not k.startswith("minifer")]
        return max(ours) / max(peers) if ours and peers else float("nan")


_CT2_TYPES = {"fp32": "float32", "bf16": "bfloat16", "int8": "int8"}


@dataclass(frozen=True)
class EngineSpec:
    """One engine of a run, described, not built: where it is built (this process or its own)
    is `run`'s choice. `kind` is ``"minifer"`` or a peer; for minifer, `kernel` is the int8
    kernel (``"weight-only"``, ``"integer"``, ``"auto"``) and `how` ``"eager"``, ``"prepacked"``
    or ``"compiled"``, and `threads` ``"auto"`` lets `generate`'s thread governor set its
    thread count."""

    name: str
    kind: str
    precision: str
    kernel: str | None = None
    how: str = "eager"
    threads: str | None = None


def engine_specs(precision: str, peers: tuple[str, ...], compiled: bool = False,
                 auto_threads: bool = False) -> list[EngineSpec]:
    """The engines a run times for `precision`: minifer's variants (with `auto_threads`, each
    also with ``generate(..., threads="auto")``), then the peers."""
    from minifer.fast.prepack import prepack_problem
    from minifer.quantization import integer_problem

    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    if precision == "fp32":
        ours = [EngineSpec("minifer", "minifer", precision)]
        if prepack_problem(torch.float32) is None:
            ours.append(EngineSpec("minifer prepacked", "minifer", precision, how="prepacked"))
    elif precision == "bf16":  # `quantize`'s bf16 model: prepacked already where it can be
        ours = [EngineSpec("minifer bf16", "minifer", precision)]
    else:
        ours = [EngineSpec("minifer int8 weight-only", "minifer", "int8", "weight-only")]
        if integer_problem() is None:
            ours += [EngineSpec(f"minifer int8 {k}", "minifer", "int8", k)
                     for k in ("integer", "auto")]
    if compiled:  # the default model of the precision, its decode step through torch.compile
        default = ours[-1] if precision == "int8" else ours[0]
        ours.append(EngineSpec(f"{default.name} compiled", "minifer", precision, default.kernel,
                               "compiled"))
    if auto_threads:
        ours += [dataclasses.replace(o, name=f"{o.name} threads=auto", threads="auto")
                 for o in ours]
    names = {"ctranslate2": f"ctranslate2 {_CT2_TYPES[precision]}",
             "openvino": f"openvino {precision}"}
    return ours + [EngineSpec(names[p], p, precision) for p in peers]


def _minifer_model(model: torch.nn.Module, precision: str, kernel: str | None):
    from minifer.quantization import quantize

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if precision == "fp32":
            return model
        if precision == "bf16":
            return quantize(model, "bf16")
        if kernel == "weight-only":
            try:
                return quantize(model, "int8", impl="fused")
            except RuntimeError:  # no fused int8 kernel in this torch: the same weights, slower
                return quantize(model, "int8", impl="reference")
        return quantize(model, "int8", impl=kernel)


def build_engine(spec: EngineSpec, model: torch.nn.Module, threads: int | None, folder: Path,
                 _models: dict | None = None):
    """`spec` built here, on `model`'s weights. A peer that does not offer the precision on this
    CPU raises ValueError. `_models` shares minifer's quantized copies between specs."""
    from minifer.fast.prepack import prepack

    if spec.kind == "ctranslate2":
        return CTranslate2Engine(model, _CT2_TYPES[spec.precision], threads, folder)
    if spec.kind == "openvino":
        return OpenVINOEngine(model, spec.precision, threads, folder)
    models = {} if _models is None else _models
    key = (spec.precision, spec.kernel)
    if key not in models:
        models[key] = _minifer_model(model, spec.precision, spec.kernel)
    ours = prepack(models[key]) if spec.how == "prepacked" else models[key]
    return MiniferEngine(ours, spec.name, compile=spec.how == "compiled", threads=spec.threads)


def _serve_engine(conn, spec: EngineSpec, model, threads: int | None, folder: str) -> None:
    """A child process's life: build `spec`, then generate on request, timing itself."""
    try:
        if threads:
            torch.set_num_threads(threads)
        engine = build_engine(spec, model, threads, Path(folder))
        del model
        conn.send(("ready", engine.name))
    except BaseException as e:  # noqa: BLE001 - the parent decides; nothing is lost
        conn.send(("error", type(e).__name__, str(e)))
        return
    while True:
        request = conn.recv()
        if request is None:
            return
        prompts, new_tokens = request
        try:
            t0 = time.perf_counter()
            tokens = engine.generate(prompts, new_tokens)
            conn.send(("done", tokens, time.perf_counter() - t0))
        except BaseException as e:  # noqa: BLE001
            conn.send(("error", type(e).__name__, str(e)))


@contextlib.contextmanager
def _interpreter(python: str):
    """Processes that multiprocessing spawns meanwhile run `python`, with that interpreter's
    own sys.path and this checkout first on it (`_ask`). A spawned child takes its sys.path
    from the parent's (the "preparation data" it is sent at its start), so ours is swapped for
    the start, as is the executable: both are process-global, and both are restored."""
    from multiprocessing import resource_tracker, spawn

    answer = _ask(python)
    if "error" in answer:
        raise RuntimeError(answer["error"])
    resource_tracker.ensure_running()  # with this interpreter, before the switch
    executable, path = spawn.get_executable(), sys.path[:]
    spawn.set_executable(python)
    sys.path[:] = answer["path"]
    try:
        yield
    finally:
        spawn.set_executable(executable)
        sys.path[:] = path


class ProcessEngine:
    """An engine built and run in a process of its own, so that no two engines share a process.

    Engines in one process share its global state: measured on a 2-core Xeon, running a
    CTranslate2 generator once (it brings its own OpenMP runtime beside torch's) left minifer's
    fp32 decode in that process 30% slower from then on (35 against 49-51 tok/s). Each call is
    timed inside the child, around the engine's own ``generate``.

    `python`: the interpreter the process runs (default: this one), e.g. a virtual
    environment's with a peer that cannot be installed beside minifer (see `_interpreter`)."""

    def __init__(self, spec: EngineSpec, model: torch.nn.Module, threads: int | None,
                 folder: Path, python: str | None = None) -> None:
        import multiprocessing

        ctx = multiprocessing.get_context("spawn")  # a fresh interpreter: nothing inherited
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(target=_serve_engine, daemon=True,
                                 args=(child, spec, model, threads, str(folder)))
        with _interpreter(python) if python else contextlib.nullcontext():
            self._proc.start()
        child.close()
        self.name, self.last_seconds = spec.name, float("nan")
        self._reply()

    def _reply(self):
        try:
            reply = self._conn.recv()
        except EOFError:
            self.close()
            raise RuntimeError(f"{self.name}: its process ended (exit code "
                               f"{self._proc.exitcode})") from None
        if reply[0] == "error":
            self.close()
            if reply[1] == "ValueError":  # e.g. a precision a peer does not offer: skipped
                raise ValueError(reply[2])
            raise RuntimeError(f"{self.name}: {reply[1]}: {reply[2]}")
        return reply

    def generate(self, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
        self._conn.send((prompts, new_tokens))
        _, tokens, self.last_seconds = self._reply()
        return tokens

    def close(self) -> None:
        if self._proc.is_alive():
            with contextlib.suppress(OSError, BrokenPipeError):
                self._conn.send(None)
            self._proc.join(30)
            if self._proc.is_alive():
                self._proc.kill()
        self._conn.close()


def _engines(model: torch.nn.Module, precision: str, threads: int | None, folder: Path,
             peers: tuple[str, ...], compiled: bool = False, isolate: bool = False,
             auto_threads: bool = False, pythons: dict[str, str] | None = None) -> list:
    """The engines of `engine_specs`, built here or each in its own process (`isolate`; a peer
    in `pythons` runs that interpreter); a peer that does not offer `precision` on this CPU is
    skipped with a message on stderr."""
    out, models = [], {}
    try:
        for spec in engine_specs(precision, peers, compiled, auto_threads):
            python = (pythons or {}).get(spec.kind)
            try:
                out.append(ProcessEngine(spec, model, threads, folder, python) if isolate
                           else build_engine(spec, model, threads, folder, models))
            except ValueError as e:  # the precision not offered on this CPU, a shape not exported
                if spec.kind == "minifer":
                    raise
                print(f"peers: {precision}: skipping {spec.kind}: {e}", file=sys.stderr)
    except BaseException:
        _close(out)  # the processes started so far
        raise
    return out


def _close(engines: list) -> None:
    for e in engines:
        if isinstance(e, ProcessEngine):
            e.close()


def run(preset: str = "gpt2", precisions: tuple[str, ...] = ("fp32", "int8"),
        batches: tuple[int, ...] = (1, 16), prompt_len: int = 32, new_tokens: int = 32,
        rounds: int = 3, threads: int | None = None, seed: int = 0,
        model: GPT | None = None, peers: tuple[str, ...] | None = None,
        busy_cores: int = 0, compiled: bool = False, isolate: bool = True,
        auto_threads: bool = False, peer_python: dict[str, str] | None = None) -> list[PeerRow]:
    """Every precision × batch: agreement with minifer's greedy tokens and decode tokens/s of
    each engine, the engines alternating within every round (one warm-up call each first).
    The model is `preset` with random weights (timings do not depend on them), or `model`.
    `peers`: the peer engines to run (default: every one in `PEERS` that is installed); one
    that is not installed, or does not offer a precision on this CPU, is skipped with a
    message on stderr. A precision that no peer offers is left out of the rows.
    `busy_cores`: processes that each keep a core busy while the timed rounds run (a
    student's laptop with something else running; `common.background_load`).
    `compiled`: also run each precision's default minifer model with ``compile=True`` (the
    first call for each batch size compiles, in the warm-up).
    `isolate`: build and run every engine in a process of its own (`ProcessEngine`), each
    with `threads` threads; False runs them all in this process, as before 2026-12-05.
    `auto_threads`: also run each minifer engine with ``generate(..., threads="auto")``.
    `peer_python`: peer -> the interpreter its process runs (`check_interpreter`; with
    `isolate` only), e.g. ``{"openvino": "/work/ov-venv/bin/python"}``: that peer is judged,
    built and run there."""
    pythons = {k: check_interpreter(k, v) for k, v in (peer_python or {}).items()}
    if pythons and not isolate:
        raise ValueError("peer_python needs each engine in a process of its own (isolate=True)")
    if problem := peers_problem(pythons):
        raise RuntimeError(f"python -m minifer_course.bench peers: {problem}")
    problems = peer_problems(pythons)
    unknown = set(peers or ()) - set(PEERS)
    if unknown:
        raise ValueError(f"unknown peers {sorted(unknown)}; choose from {PEERS}")
    for peer in peers or PEERS:
        if problems[peer] is not None:
            print(f"peers: skipping {peer}: it {problems[peer]}", file=sys.stderr)
    chosen = tuple(p for p in (peers or PEERS) if problems[p] is None)
    if not chosen:
        raise RuntimeError(f"python -m minifer_course.bench peers: none of {peers} can run here")
    model = (GPT.from_config(preset, seed=seed) if model is None else model).eval()
    gen = torch.Generator().manual_seed(seed)
    rows = []
    with tempfile.TemporaryDirectory(prefix="minifer-peers-") as tmp:
        for precision in precisions:
            engines = _engines(model, precision, threads, Path(tmp), chosen, compiled,
                               isolate=isolate, auto_threads=auto_threads, pythons=pythons)
            try:
                if any(not e.name.startswith("minifer") for e in engines):
                    rows += _time_engines(engines, model, precision, batches, prompt_len,
                                          new_tokens, rounds, busy_cores, gen)
            finally:
                _close(engines)
    return rows


def _time_engines(engines: list, model: GPT, precision: str, batches: tuple[int, ...],
                  prompt_len: int, new_tokens: int, rounds: int, busy_cores: int,
                  gen: torch.Generator) -> list[PeerRow]:
    from .common import background_load

    rows = []
    for batch in batches:
        prompts = torch.randint(0, model.config.vocab_size, (batch, prompt_len),
                                generator=gen).tolist()
        outs = {e.name: e.generate(prompts, new_tokens) for e in engines}  # warm-up
        first = outs[engines[0].name]
        agree = {k: agreement(first, v) for k, v in outs.items() if k != engines[0].name}
        ones: dict[str, list[float]] = {e.name: [] for e in engines}
        alls: dict[str, list[float]] = {e.name: [] for e in engines}
        with background_load(busy_cores):
            for _ in range(rounds):
                for e in engines:
                    ones[e.name].append(timed(e, prompts, 1))
                    alls[e.name].append(timed(e, prompts, new_tokens))
        rows.append(PeerRow(
            precision, batch,
            {k: decode_rate(batch, new_tokens, statistics.median(ones[k]),
                            statistics.median(alls[k]), max(ones[k]) - min(ones[k]))
             for k in alls},
            {k: max(v) / min(v) for k, v in alls.items()}, agree,
            {k: list(zip(ones[k], alls[k])) for k in alls}))
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

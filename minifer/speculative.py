"""Speculative decoding: a cheap drafter guesses k tokens, the target checks them in one pass.

At batch 1 a decode pass is limited by reading the weights, so checking k + 1 tokens costs about
as much as producing one (claim SPEC-1). The target runs once over ``[last token, d1 … dk]`` and
keeps the drafted prefix it agrees with plus one token of its own.

- **Greedy**: a draft token is kept when it equals the target's argmax, so the output is the
  target's own greedy output (SPEC-2; token for token in fp32).
- **Sampling**: draft token d ~ q is accepted with probability min(1, p(d)/q(d)); at the first
  rejection a token is drawn from normalise(max(0, p − q)), after k acceptances from p: the
  output follows p exactly (Leviathan et al. 2023; Chen et al. 2023; p, q: `minifer.generate`'s
  logits processing). `ModelDrafter` runs a small model with its own KV cache;
  `PromptLookupDrafter` needs no model (a deterministic proposal is a valid q). Batch 1."""

from __future__ import annotations

import time
from collections import abc
from collections.abc import Callable
from dataclasses import dataclass, field, fields

import torch

from . import hooks
from .cache import StaticKVCache
from .checks import check_int
from .device import sync
from .generation import advance, prefill
from .sampling import (
    SamplingParams,
    draw,
    make_generators,
    mask_padded_vocab,
    process_logits,
    sample,
    seen_mask,
)
from .sequence import Completion, Sequence, check_model, prepare

__all__ = ["SpecStats", "SpecCompletion", "Drafter", "DraftContext", "ModelDrafter",
           "PromptLookupDrafter", "speculative_generate", "accept_with_ratio", "verify",
           "check_draft", "check_tokenizers", "expected_tokens_per_pass", "expected_speedup"]


# ---- statistics ------------------------------------------------------------------------------
@dataclass
class SpecStats:
    """What one speculative run did (`target_passes` includes the prefill; without an early
    stop, ``tokens == accepted + target_passes``)."""

    k: int
    drafter: str = ""
    tokens: int = 0  # generated tokens
    target_passes: int = 0  # prefill + verification passes
    draft_passes: int = 0  # forward passes of the draft model (prefill included; 0 for lookup)
    rounds: int = 0  # verification passes
    proposed: int = 0  # draft tokens the target checked
    accepted: int = 0  # of those, kept
    rejections: int = 0  # rounds that stopped at a rejected draft token
    accept_hist: list[int] = field(default_factory=list)  # rounds that accepted 0, 1, …, k drafts
    draft_time_s: float = 0.0
    target_time_s: float = 0.0  # target passes + the acceptance step
    wall_time_s: float = 0.0
    prompts: int = 1  # runs merged into these stats (several prompts run one after another)

    def __post_init__(self) -> None:
        if not self.accept_hist:
            self.accept_hist = [0] * (self.k + 1)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens (an estimate of α)."""
        return self.accepted / self.proposed if self.proposed else float("nan")

    @property
    def alpha(self) -> float:
        """Per-token acceptance probability α: accepted / (accepted + rejections) (drafts after a
        rejection were never tested, so accepted / proposed underestimates α)."""
        tested = self.accepted + self.rejections
        return self.accepted / tested if tested else float("nan")

    @property
    def tokens_per_pass(self) -> float:
        """Generated tokens per target forward pass (plain decoding: 1)."""
        return self.tokens / self.target_passes if self.target_passes else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_time_s if self.wall_time_s > 0 else float("nan")

    def add_round(self, accepted: int, proposed: int) -> None:
        """One verification pass that kept `accepted` of `proposed` drafts (and one token more)."""
        self.rounds, self.target_passes = self.rounds + 1, self.target_passes + 1
        self.tokens += accepted + 1
        self.proposed, self.accepted = self.proposed + proposed, self.accepted + accepted
        self.rejections += accepted < proposed
        self.accept_hist[accepted] += 1

    def merge(self, other: SpecStats) -> SpecStats:
        """The sum of two runs' stats (same k)."""
        if other.k != self.k:
            raise ValueError(f"cannot merge stats of k={self.k} and k={other.k}")
        sums = {f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)
                if f.name not in ("k", "drafter", "accept_hist")}
        return SpecStats(k=self.k, drafter=self.drafter, **sums,
                         accept_hist=[a + b for a, b in zip(self.accept_hist, other.accept_hist)])

    def summary(self) -> str:
        return (f"{self.tokens} tokens in {self.target_passes} target passes "
                f"({self.tokens_per_pass:.2f} tokens/pass), {self.accepted}/{self.proposed} "
                f"draft tokens accepted ({self.acceptance_rate:.0%}), k={self.k}, "
                f"drafter={self.drafter}")


@dataclass
class SpecCompletion(Completion):
    """A `Completion` with the speculative run's `stats`."""

    stats: SpecStats | None = None


def expected_tokens_per_pass(alpha: float, k: int) -> float:
    """Leviathan et al.'s expected tokens per target pass: (1 − α^(k+1)) / (1 − α)."""
    return float(k + 1) if alpha >= 1.0 else (1.0 - alpha ** (k + 1)) / (1.0 - alpha)


def expected_speedup(alpha: float, k: int, c: float) -> float:
    """Expected wall-time speed-up over plain decoding, with c = draft pass cost / target pass
    cost: tokens per pass / (k·c + 1) (Leviathan et al. 2023, Theorem 3.8)."""
    return expected_tokens_per_pass(alpha, k) / (k * c + 1.0)


# ---- drafters --------------------------------------------------------------------------------
@dataclass
class DraftContext:
    """What a drafter needs to know about the run (set once per prompt)."""

    params: SamplingParams
    vocab: int  # leading vocabulary entries that may be sampled
    vocab_size: int  # the model's vocabulary (logits width)
    device: torch.device
    generator: torch.Generator | None
    max_len: int
    k: int  # most tokens drafted per round


class Drafter:
    """Proposes draft tokens; `passes` counts its model forward passes.

    - ``begin(prompt_ids, ctx)``: a new sequence starts (a model drafter prefills here);
    - ``propose(seq, k, seen)`` → ``(tokens, q)``: up to k draft tokens ``(n,)`` continuing the
      host list `seq` and, when sampling, their distributions ``(n, V)`` (None: deterministic);
    - ``commit(accepted, proposed)``: the target kept the first `accepted` of `proposed` tokens."""

    name = "drafter"
    passes = 0

    def begin(self, prompt_ids: list[int], ctx: DraftContext) -> None:
        self.ctx = ctx
        self.passes = 0

    def propose(self, seq: list[int], k: int, seen: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def commit(self, accepted: int, proposed: int) -> None:
        pass


class ModelDrafter(Drafter):
    """A small language model drafts, with its own `StaticKVCache` kept in step with the target's."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.name = f"draft model ({sum(p.numel() for p in model.parameters()):,} params)"

    def begin(self, prompt_ids: list[int], ctx: DraftContext) -> None:
        super().begin(prompt_ids, ctx)
        cache = getattr(self, "cache", None)
        if cache is None or cache.max_len < ctx.max_len or cache.device != ctx.device:
            cache = StaticKVCache.for_model(self.model, 1, ctx.max_len, device=ctx.device)
        self.cache = cache  # reused by the next prompt or call when it is big enough
        self.cache.reset()
        ids = torch.tensor([prompt_ids], device=ctx.device)
        prefill(self.model, ids, self.cache)  # the draft's logits here are not needed
        self.passes += 1
        self.n_cached = len(prompt_ids)  # tokens of the sequence in the draft's cache

    def propose(self, seq, k, seen):
        ctx, params, tokens, qs = self.ctx, self.ctx.params, [], []
        if k == 0:
            return torch.empty(0, dtype=torch.long, device=ctx.device), None
        x = torch.tensor([seq[self.n_cached:]], device=ctx.device)  # 1 token, or 2 after a full accept
        self.n_cached = len(seq)
        seen = None if seen is None else seen.clone()
        for _ in range(k):
            logits = self.model(x, cache=self.cache, last_only=True)[:, -1]  # (1, V)
            self.passes += 1
            mask_padded_vocab(logits, ctx.vocab)
            proc = logits if params.plain_argmax else process_logits(logits, params, seen)
            if params.greedy:
                tokens.append(proc[0].argmax())
            else:
                qs.append(proc[0].softmax(dim=-1))
                tokens.append(draw(qs[-1], ctx.generator))
            x = tokens[-1].view(1, 1)
            if seen is not None:
                seen[0, tokens[-1]] = True
        # The cache now holds seq + d1..d(k-1); dk was never fed.
        return torch.stack(tokens), torch.stack(qs) if qs else None

    def commit(self, accepted, proposed):
        if proposed == 0:
            return
        keep = min(accepted, proposed - 1)  # d1..d_accepted stay (dk is not in the cache)
        self.cache.rollback(proposed - 1 - keep)
        self.n_cached += keep


class PromptLookupDrafter(Drafter):
    """Prompt lookup decoding: propose the tokens that followed the latest earlier occurrence of
    the last `max_ngram` (down to `min_ngram`) tokens; no forward pass, no match no proposal."""

    def __init__(self, max_ngram: int = 3, min_ngram: int = 1) -> None:
        min_ngram = check_int("min_ngram", min_ngram, 1)
        max_ngram = check_int("max_ngram", max_ngram, min_ngram, why=" (at least min_ngram)")
        self.max_ngram, self.min_ngram = max_ngram, min_ngram
        self.name = f"prompt lookup (n-grams {min_ngram}..{max_ngram})"

    @staticmethod
    def lookup(seq: abc.Sequence[int], k: int, max_ngram: int = 3, min_ngram: int = 1) -> list[int]:
        """Up to k tokens that followed the latest earlier match of seq's last n-gram."""
        L = len(seq)
        for n in range(min(max_ngram, L - 1), min_ngram - 1, -1):
            pattern = list(seq[L - n:])
            first = pattern[0]
            for i in range(L - n - 1, -1, -1):
                if seq[i] == first and list(seq[i:i + n]) == pattern:
                    return list(seq[i + n:i + n + k])
        return []

    def propose(self, seq, k, seen):
        found = self.lookup(seq, k, self.max_ngram, self.min_ngram) if k > 0 else []
        return torch.tensor(found, dtype=torch.long, device=self.ctx.device), None


def _as_drafter(draft) -> Drafter:
    if isinstance(draft, Drafter):
        return draft
    if isinstance(draft, torch.nn.Module) and hasattr(draft, "config"):
        return ModelDrafter(draft)
    raise ValueError(f"draft must be a GPT model or a Drafter (e.g. PromptLookupDrafter()), "
                     f"got {type(draft).__name__}")


# ---- the acceptance rule ---------------------------------------------------------------------
AcceptRule = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def accept_with_ratio(p_d: torch.Tensor, q_d: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Accept draft token d with probability min(1, p(d)/q(d)), i.e. when u·q(d) < p(d) for
    u ~ U[0, 1): the rule that keeps the target's distribution. Without a division, q(d) = 0
    accepts when p(d) > 0 and never when p(d) = 0."""
    return u * q_d < p_d


def verify(logits: torch.Tensor, drafts: torch.Tensor, q: torch.Tensor | None,
           params: SamplingParams, seen: torch.Tensor | None, generator: torch.Generator | None,
           accept: AcceptRule = accept_with_ratio) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's verdict on n drafts from its logits ``(n+1, V)`` at ``[pending, d1..dn]``:
    (drafts accepted, the token after them), on the device, by the module doc's rules (`accept`
    when sampling; `q` ``(n, V)``, None: a deterministic proposal, one-hot). `seen` ``(1, V)``:
    the tokens before the drafts."""
    n, rows = drafts.shape[0], torch.arange(drafts.shape[0] + 1, device=logits.device)
    if seen is not None:  # the drafts before a position count as seen there
        onehot = torch.zeros(n + 1, seen.shape[-1], dtype=torch.long, device=seen.device)
        onehot[rows[1:], drafts] = 1
        seen = seen | (onehot.cumsum(0) > 0)  # (n+1, V)
    proc = logits if params.plain_argmax else process_logits(logits, params, seen)
    if params.greedy:
        choice = proc.argmax(dim=-1)  # (n+1,)
        a = (choice[:n] == drafts).long().cumprod(0).sum()
        return a, choice.index_select(0, a.view(1))[0]
    p = proc.softmax(dim=-1)  # (n+1, V)
    if q is None:
        q = torch.zeros_like(p[:n])
        q[rows[:n], drafts] = 1.0
    u = torch.rand(n, device=p.device, generator=generator)
    a = accept(p[rows[:n], drafts], q[rows[:n], drafts], u).long().cumprod(0).sum()
    resid = torch.cat([(p[:n] - q).clamp_(min=0), p[n:]])  # after a rejection at i; all kept: p
    row = resid.index_select(0, a.view(1))[0]
    row = torch.where(row.sum() > 0, row, p.index_select(0, a.view(1))[0])  # p == q: use p
    return a, draw(row, generator)


def check_draft(draft: torch.nn.Module, target: torch.nn.Module, name: str = "draft") -> None:
    """`check_model`'s errors, or a ValueError unless `draft` shares `target`'s vocabulary (size,
    end-of-sequence id) and device."""
    check_model(draft, name)
    d, t = draft.config, target.config
    if d.vocab_size != t.vocab_size or d.eos_token_id != t.eos_token_id:
        raise ValueError(f"{name} and the target must share a vocabulary: {name} has "
                         f"{d.vocab_size} tokens (eos {d.eos_token_id}), the target must have "
                         f"{t.vocab_size} (eos {t.eos_token_id})")
    if next(draft.parameters()).device != next(target.parameters()).device:
        raise ValueError(f"{name} and the target must be on the same device "
                         f"({next(target.parameters()).device}): move it with .to(device)")


def check_tokenizers(tokenizer, draft_tokenizer) -> None:
    if tokenizer is None or draft_tokenizer is None or draft_tokenizer is tokenizer:
        return
    same = (type(tokenizer) is type(draft_tokenizer)
            and tokenizer.vocab_size == draft_tokenizer.vocab_size
            and tokenizer.eos_token_id == draft_tokenizer.eos_token_id)
    hf_a, hf_b = getattr(tokenizer, "hf", None), getattr(draft_tokenizer, "hf", None)
    if same and hf_a is not None and hf_b is not None:
        same = hf_a.get_vocab(with_added_tokens=True) == hf_b.get_vocab(with_added_tokens=True)
    if not same:
        raise ValueError("the draft's tokenizer differs from the target's: draft tokens would mean "
                         "different text; speculative decoding needs one shared vocabulary")


# ---- the loop --------------------------------------------------------------------------------
def speculative_generate(target: torch.nn.Module, draft, prompts,
                         params: SamplingParams | None = None, k: int = 4, tokenizer=None, *,
                         draft_tokenizer=None, target_cache: StaticKVCache | None = None,
                         accept: AcceptRule = accept_with_ratio,
                         threads: int | str | None = None) -> list[SpecCompletion]:
    """Generate with speculative decoding: one `SpecCompletion` (with `.stats`) per prompt.

    `draft`: a small GPT sharing the target's vocabulary, or any `Drafter`. `k`: tokens drafted
    per target pass. Stops like `minifer.generate` (in bf16/fp16 a greedy near-tie can flip).
    `draft_tokenizer`: checked against `tokenizer`. `target_cache`: a batch-1 `StaticKVCache`
    to use (and leave filled). `accept(p_d, q_d, u)`: the acceptance rule when sampling."""
    check_int("k (draft tokens per target pass)", k, 1)
    if not callable(accept):
        raise TypeError(f"accept must be a function (p_d, q_d, u) -> bool tensor, got {accept!r}")
    drafter = _as_drafter(draft)
    cfg = target.config
    device = next(target.parameters()).device
    windows = {"target": cfg.context_length}
    if isinstance(drafter, ModelDrafter):
        check_draft(drafter.model, target)
        windows["draft model"] = drafter.model.config.context_length
    check_tokenizers(tokenizer, draft_tokenizer)
    req = prepare(target, prompts, params, tokenizer, context_lengths=windows)
    if target_cache is not None:
        need = max(s.max_len for s in req.sequences)
        if target_cache.batch_size != 1 or target_cache.max_len < need:
            raise ValueError(f"target_cache must have batch_size 1 and max_len >= {need}, got "
                             f"{target_cache.batch_size} and {target_cache.max_len}")
    with hooks.generation_threads(threads, device) as between_steps:
        run = _SpecRun(target, drafter, k, req.vocab, device, accept, between_steps)
        return [run.generate(seq, target_cache) for seq in req.sequences]


class _SpecRun:
    """Speculative decoding of one sequence at a time: the buffers and rules shared by a call."""

    def __init__(self, target: torch.nn.Module, drafter: Drafter, k: int, vocab: int,
                 device: torch.device, accept: AcceptRule,
                 between_steps: Callable[[], None]) -> None:
        self.target, self.drafter, self.k = target, drafter, k
        self.between_steps = between_steps  # the thread count's hook (`hooks.generation_threads`)
        self.vocab, self.device, self.accept = vocab, device, accept
        self.V = target.config.vocab_size

    def generate(self, seq: Sequence, cache: StaticKVCache | None) -> SpecCompletion:
        """Prefill, then rounds of draft → verify → accept: `advance` with a multi-token step."""
        params, device = seq.params, self.device
        stats = SpecStats(k=self.k, drafter=self.drafter.name)
        gens = make_generators(params, 1, device)
        self.gen = gen = None if gens is None else gens[0]
        self.seen = seen_mask([seq.prompt_ids], self.V, device) if params.repetition_penalty != 1.0 else None
        ctx = DraftContext(params, self.vocab, self.V, device, gen, seq.max_len, self.k)
        tokens = list(seq.prompt_ids)  # the sequence so far, as the drafter sees it
        started = False

        def step() -> list[list[int]]:
            """The first step prefills (target, then drafter) and samples one token; every
            later one is a round: the accepted drafts, then the target's own next token."""
            nonlocal cache, started
            self.between_steps()
            if not started:
                started = True
                t0 = time.perf_counter()
                if cache is None:
                    cache = StaticKVCache.for_model(self.target, 1, seq.max_len, device=device)
                cache.reset()
                logits = prefill(self.target, torch.tensor([seq.prompt_ids], device=device), cache)
                mask_padded_vocab(logits, self.vocab)
                first = int(sample(logits, params, self.seen, None if gen is None else [gen])[0])
                stats.target_passes += 1
                t1 = time.perf_counter()
                stats.target_time_s += t1 - t0
                self.drafter.begin(seq.prompt_ids, ctx)
                stats.draft_time_s += time.perf_counter() - t1
                return [[first]]
            new = seq.output_ids[len(tokens) - len(seq.prompt_ids):]
            tokens.extend(new)
            if self.seen is not None:  # (repetition penalty)
                self.seen[0, new] = True
            accepted, drafted, pending = self._round(seq, tokens, cache, stats)
            return [drafted[:accepted] + [pending]]

        with torch.inference_mode():
            t0 = time.perf_counter()
            for _ in advance([seq], step, t0):  # the generation loop, with this step
                pass
            sync(device)
            stats.wall_time_s = time.perf_counter() - t0
        stats.tokens = len(seq.output_ids)
        stats.draft_passes = self.drafter.passes
        return SpecCompletion(**vars(seq.result), stats=stats)

    def _round(self, seq: Sequence, tokens: list[int], cache: StaticKVCache,
               stats: SpecStats) -> tuple[int, list[int], int]:
        """Draft up to k tokens, verify them in one target pass, roll back the rest: (accepted
        drafts, the drafts, the target's own next token)."""
        params = seq.params
        remaining = params.max_new_tokens - len(seq.output_ids)
        k_eff = min(self.k, remaining - 1)  # a round yields at most k_eff + 1 tokens
        td = time.perf_counter()
        drafts, q = self.drafter.propose(tokens, k_eff, self.seen)
        n = drafts.shape[0]
        tt = time.perf_counter()
        stats.draft_time_s += tt - td

        # One target pass over [pending, d1..dn]: logits for the position after each.
        ids = torch.cat([torch.tensor([tokens[-1]], device=self.device), drafts])
        logits = self.target(ids.view(1, -1), cache=cache)[0]  # (n+1, V)
        mask_padded_vocab(logits, self.vocab)
        a, nxt = verify(logits, drafts, q, params, self.seen, self.gen, self.accept)
        host = torch.cat([drafts, a.view(1), nxt.view(1)]).tolist()  # the round's one transfer
        accepted, pending = host[n], host[n + 1]
        cache.rollback(n - accepted)  # keep pending + d1..d_accepted
        stats.add_round(accepted, n)
        td = time.perf_counter()
        stats.target_time_s += td - tt
        self.drafter.commit(accepted, n)
        stats.draft_time_s += time.perf_counter() - td
        return accepted, host[:n], pending

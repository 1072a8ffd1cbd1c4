"""What minifer is measured against: the textbook engine and Hugging Face `transformers`.

Both run the *same weights* as the minifer model they are built from, so any difference in speed
is the engine's, and greedy fp32 output is checked identical before anything is timed.

* `TextbookEngine` — the KV cache as students first write it: a list of (K, V) per layer that
  grows by ``torch.cat`` at every step (so every step copies the whole cache), attention written
  out as softmax(QKᵀ/√d)V, and no batching tricks. Correct, and the usual starting point.
* `to_hf` — the model exported to a `transformers` ``GPT2LMHeadModel`` (the inverse of
  `GPT.from_hf`), for timing `generate` from the library most people use. `transformers` is an
  optional dependency (``pip install minifer[hf]``); `hf_available` says whether it is there.

Each engine offers the same timed unit: from a prompt already in its cache, greedy-decode ``n``
tokens per row and return them ``(B, n)``; the cache is put back to the prompt afterwards, so the
unit can be timed again and again at the same context.
"""

from __future__ import annotations

import importlib.util
import math

import torch
import torch.nn.functional as F

from minifer import hooks
from minifer.cache import StaticKVCache
from minifer.checks import check_int
from minifer.generation import decode_step, prefill

__all__ = ["TextbookEngine", "MinifierDecoder", "HFDecoder", "to_hf", "hf_available",
           "random_past"]

Past = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (K, V), [B, kv_heads, T, head_dim]


def hf_available() -> bool:
    """Whether `transformers` can be imported (the `hf` extra)."""
    return importlib.util.find_spec("transformers") is not None


def random_past(model: torch.nn.Module, batch: int, tokens: int, seed: int = 0) -> Past:
    """A prompt's K/V for every layer without computing the prompt: random values, shaped
    ``[batch, kv_heads, tokens, head_dim]`` in the model's dtype and device.

    A decode step does the same work whatever values its cache holds, so a benchmark can start
    every engine from the same random cache instead of paying a prefill per engine (for GPT-2
    124M at batch 64 and 128 tokens that prefill is a few TFLOP: minutes on a 2-core CPU).
    Given the same cache and the same last token, the engines must still agree token for token.
    """
    cfg = model.config
    check_int("tokens", tokens, 0, cfg.context_length - 1,
              why=" (the model's context, less the token to decode)")
    p = next(model.parameters())
    gen = torch.Generator().manual_seed(seed)
    shape = (batch, cfg.kv_heads, tokens, cfg.head_dim)
    return [tuple(torch.randn(shape, generator=gen).to(device=p.device, dtype=p.dtype)
                  for _ in range(2)) for _ in range(cfg.n_layer)]


def _check_past(past: Past, prompt: torch.Tensor) -> None:
    B, T = prompt.shape
    k = past[0][0]
    if k.shape[0] != B or k.shape[2] != T - 1:
        raise ValueError(f"past must hold the K/V of all but the prompt's last token "
                         f"({B} rows, {T - 1} tokens), got {k.shape[0]} rows, {k.shape[2]} tokens")


# ---- the textbook engine -------------------------------------------------------------------
class TextbookEngine:
    """The classic first KV cache, on a minifer model's weights: K/V concatenated every step.

    Supports what the benchmark needs: a batch of equal-length prompts, greedy decoding.
    """

    name = "textbook"

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.last: torch.Tensor | None = None  # the prompt's next token

    def forward(self, ids: torch.Tensor, past):
        """Logits ``(B, T, V)`` for `ids` after the cached `past`; returns (logits, new past)."""
        m, cfg = self.model, self.model.config
        B, T = ids.shape
        offset = 0 if past is None else past[0][0].shape[2]
        pos = torch.arange(offset, offset + T, device=ids.device)
        x = m.transformer.wte(ids) + m.transformer.wpe(pos)
        nh, nkv, hd = cfg.n_head, cfg.kv_heads, cfg.head_dim
        new_past = []
        for i, block in enumerate(m.transformer.h):
            a = block.attn
            q, k, v = a.c_attn(block.ln_1(x)).split([nh * hd, nkv * hd, nkv * hd], dim=2)
            q = q.view(B, T, nh, hd).transpose(1, 2)
            k = k.view(B, T, nkv, hd).transpose(1, 2)
            v = v.view(B, T, nkv, hd).transpose(1, 2)
            if past is not None:  # the textbook move: a new, longer tensor every step
                k = torch.cat([past[i][0], k], dim=2)
                v = torch.cat([past[i][1], v], dim=2)
            new_past.append((k, v))
            if nkv != nh:
                k = k.repeat_interleave(nh // nkv, dim=1)
                v = v.repeat_interleave(nh // nkv, dim=1)
            att = (q @ k.transpose(-2, -1)) / math.sqrt(hd)  # (B, nh, T, S)
            if T > 1:
                S = att.shape[-1]
                causal = torch.ones(T, S, dtype=torch.bool, device=ids.device).tril(S - T)
                att = att.masked_fill(~causal, float("-inf"))
            y = (att.softmax(dim=-1) @ v).transpose(1, 2).reshape(B, T, nh * hd)
            x = x + a.c_proj(y)
            x = x + block.mlp.c_proj(F.gelu(block.mlp.c_fc(block.ln_2(x)), approximate="tanh"))
        return m.lm_head(m.transformer.ln_f(x)), new_past

    def start(self, prompt: torch.Tensor, new_tokens: int = 0, past: Past | None = None) -> None:
        """Run the prompt ``(B, T)`` once and keep its K/V (all but the last token) and the
        token it predicts; with `past` (e.g. `random_past`), take that as the prompt's K/V."""
        if past is not None:
            _check_past(past, prompt)
            self.past = list(past) if prompt.shape[1] > 1 else None
        else:
            with torch.inference_mode():
                self.past = self.forward(prompt[:, :-1], None)[1] if prompt.shape[1] > 1 else None
        self.prompt_last = prompt[:, -1:]

    def decode(self, n: int) -> torch.Tensor:
        """Greedy ``n`` tokens per row from the prompt; the prompt's cache is kept as it was
        (the concatenations made new tensors)."""
        tok, past, out = self.prompt_last, self.past, []
        with torch.inference_mode():
            for _ in range(n):
                logits, past = self.forward(tok, past)
                tok = logits[:, -1].argmax(-1, keepdim=True)
                out.append(tok)
                tok.tolist()  # the host learns the token, as a streaming loop must
        return torch.cat(out, dim=1)


# ---- minifer itself, in the same harness ---------------------------------------------------
class MinifierDecoder:
    """minifer's decode loop in the benchmark's unit: `decode_step` + greedy choice per token.

    `compile`: use `minifer.fast.compiled.compiled_decode` (torch.compile) for the step;
    otherwise the eager step `generate` runs.
    """

    def __init__(self, model: torch.nn.Module, *, compile: bool = False) -> None:
        from minifer.fast.compiled import compiled_decode

        self.model = model
        self.compiled = compiled_decode(model) if compile else None
        self.name = "minifer compiled" if compile else "minifer"

    def start(self, prompt: torch.Tensor, new_tokens: int, past: Past | None = None) -> None:
        """Prefill all but the prompt's last token (or copy `past` into the cache)."""
        B, T = prompt.shape
        self.cache = StaticKVCache.for_model(self.model, B, T + new_tokens)
        self.step = self.compiled or hooks.decode_function(self.model, self.cache, False)
        with torch.inference_mode():
            self.cache.reset()
            if past is not None:
                _check_past(past, prompt)
                for i, (k, v) in enumerate(past):
                    self.cache.update(i, k, v)
                self.cache.advance(T - 1)
            elif T > 1:
                prefill(self.model, prompt[:, :-1], self.cache)
        self.prompt_last = prompt[:, -1]
        self.pos0 = self.cache.pos

    def decode(self, n: int) -> torch.Tensor:
        tok, out = self.prompt_last, []
        with torch.inference_mode():
            for _ in range(n):
                tok = decode_step(self.model, tok, self.cache, step=self.step).argmax(-1)
                out.append(tok)
                tok.tolist()
        self.cache.rollback(self.cache.pos - self.pos0)
        return torch.stack(out, dim=1)


# ---- transformers ---------------------------------------------------------------------------
_TRANSPOSED = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")


def to_hf(model: torch.nn.Module):
    """The model as a `transformers` ``GPT2LMHeadModel`` with the same weights and dtype.

    GPT-2 keeps its linear layers as ``Conv1D`` (weight stored transposed): those are transposed
    on the way out. Only what GPT-2 can express is exported (multi-head attention, biases).
    """
    if not hf_available():
        raise ImportError("to_hf needs transformers: pip install 'minifer[hf]'")
    import transformers

    cfg = model.config
    if cfg.kv_heads != cfg.n_head or not cfg.bias:
        raise ValueError("to_hf exports GPT-2-shaped models only (n_kv_head=None, bias=True), "
                         f"got n_kv_head={cfg.n_kv_head}, bias={cfg.bias}")
    hc = transformers.GPT2Config(
        vocab_size=cfg.vocab_size, n_positions=cfg.context_length, n_layer=cfg.n_layer,
        n_head=cfg.n_head, n_embd=cfg.n_embd, layer_norm_epsilon=cfg.layer_norm_eps,
        activation_function="gelu_new", tie_word_embeddings=cfg.tie_embeddings,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
        bos_token_id=cfg.eos_token_id, eos_token_id=cfg.eos_token_id,
    )
    dtype = next(model.parameters()).dtype
    hf = transformers.GPT2LMHeadModel(hc).to(dtype=dtype)
    dst = hf.state_dict()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            w = p.t() if name.endswith(_TRANSPOSED) else p
            if dst[name].shape != w.shape:
                raise ValueError(f"to_hf: {name} has shape {tuple(w.shape)}, "
                                 f"transformers expects {tuple(dst[name].shape)}")
            dst[name].copy_(w)
    return hf.eval()


class HFDecoder:
    """`transformers` ``generate`` (greedy) continuing from the prompt in a `DynamicCache`."""

    name = "transformers"

    def __init__(self, model: torch.nn.Module) -> None:
        import inspect

        self.hf = to_hf(model)
        # transformers 5 renamed `past_key_values` to `cache`; use whichever this version takes
        params = inspect.signature(self.hf.forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"

    def start(self, prompt: torch.Tensor, new_tokens: int, past: Past | None = None) -> None:
        from transformers import DynamicCache

        self.prompt = prompt
        self.cache = DynamicCache()
        with torch.inference_mode():
            if past is not None:
                _check_past(past, prompt)
                for i, (k, v) in enumerate(past):
                    self.cache.update(k, v, i)
            elif prompt.shape[1] > 1:
                self.hf(prompt[:, :-1], use_cache=True, **{self.cache_kw: self.cache})
        self.cached = prompt.shape[1] - 1

    def decode(self, n: int) -> torch.Tensor:
        with torch.inference_mode():
            out = self.hf.generate(
                self.prompt, attention_mask=torch.ones_like(self.prompt),
                max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
                **{self.cache_kw: self.cache})
        extra = self.cache.get_seq_length() - self.cached
        if extra:  # back to the prompt (a negative count removes tokens in every version)
            self.cache.crop(-extra)
        return out[:, self.prompt.shape[1]:]

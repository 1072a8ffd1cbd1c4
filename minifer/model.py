"""A GPT-2-family decoder in one file: learned positions, pre-LayerNorm, GELU MLP, fused QKV.

The same decoder is Llama or Qwen through the config's family switches, each chosen once at
construction so that the GPT-2 path runs exactly the code it always ran: `RMSNorm` for
LayerNorm, `GatedMLP` (SwiGLU) for the GELU MLP, and a `RotaryEmbedding` that rotates each
layer's queries and keys by their positions *before* the keys are cached (so a cached key
already holds its position) in place of the learned position table.

Shapes in comments: B batch, T new tokens, S cached + new tokens, C = n_embd,
nh query heads, nkv key/value heads, hd head dim.

The only inference-specific idea here is the `cache` argument (`minifer.cache.KVCache`): each
attention layer writes the new tokens' keys and values into it and attends over everything
cached so far, so a decode step feeds one token per sequence. What the layers need for a call is
built once, an `AttentionInputs` (the lean decode step passes its own in the cache's place)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from . import hooks
from .cache import AttentionInputs, KVCache, PackedKVCache
from .config import GPTConfig
from .device import as_device


class RMSNorm(nn.Module):
    """Llama's norm: scale each vector to unit root-mean-square, then by a learned weight (no
    mean subtracted, no bias). Computed in fp32 whatever the dtype, as Llama's reference does."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)  # x / √(mean(x²) + eps)
        return self.weight * x32.to(x.dtype)


def make_norm(config: GPTConfig, dim: int | None = None) -> nn.Module:
    """The config's norm over `dim` features (default n_embd): LayerNorm or RMSNorm."""
    dim = config.n_embd if dim is None else dim
    if config.norm == "rms":
        return RMSNorm(dim, eps=config.layer_norm_eps)
    return nn.LayerNorm(dim, eps=config.layer_norm_eps, bias=config.bias)


class RotaryEmbedding(nn.Module):
    """Rotary positions (RoPE, Su et al. 2021): the pair of dims (i, i + hd/2) of every query and
    key head is rotated by the angle ``position × inv_freq[i]``, so a query·key product depends
    only on the two tokens' distance. Keys are cached rotated: a cached entry is tied to its
    position (prefix caching reuses a prefix's K/V at the same positions). The frequencies stay
    fp32 whatever the model's dtype (bf16 angles would be off by whole turns far out)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        hd = config.head_dim
        steps = torch.arange(0, hd, 2, dtype=torch.float, device="cpu") / hd  # (hd/2,)
        inv_freq = 1.0 / (config.rope_theta ** steps)
        if config.rope_scaling is not None:
            inv_freq = llama3_scaled(inv_freq, config.rope_scaling)
        self.inv_freq = inv_freq  # (hd/2,)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin ``(B, 1, T, hd/2)`` of the angles of `positions` ``(B, T)``, in `dtype`:
        computed once per forward call, used by every layer (`rotate`)."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        angles = positions[:, None, :, None].float() * self.inv_freq  # (B, 1, T, hd/2)
        return angles.cos().to(dtype), angles.sin().to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x1[i], x2[i]) of the halves of `x`'s last dim by the angle of cos/sin."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def llama3_scaled(inv_freq: torch.Tensor, s) -> torch.Tensor:
    """Llama 3's frequency scaling (`minifer.config.RopeScaling`), as Meta's reference computes
    it: low frequencies divided by ``s.factor``, high ones kept, the band between blended."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = s.original_context_length / s.low_freq_factor  # longer than this: scaled
    high_wavelen = s.original_context_length / s.high_freq_factor  # shorter than this: kept
    scaled = torch.where(wavelen > low_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (s.original_context_length / wavelen - s.low_freq_factor) / (
        s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_head, self.n_kv_head, self.head_dim = config.n_head, config.kv_heads, config.head_dim
        qkv_out = (self.n_head + 2 * self.n_kv_head) * self.head_dim
        self.c_attn = nn.Linear(config.n_embd, qkv_out, bias=config.bias or config.qkv_bias)
        self.c_proj = nn.Linear(self.n_head * self.head_dim, config.n_embd, bias=config.bias)
        self.impl = "sdpa"  # "sdpa" (fused, memory-lean) or "math" (materialises the T×S scores)
        # Qwen3: an RMSNorm over each head's query and key before they are rotated.
        norm = config.qk_norm
        self.q_norm = make_norm(config, self.head_dim) if norm else nn.Identity()
        self.k_norm = make_norm(config, self.head_dim) if norm else nn.Identity()

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        return self.c_proj(self.attend(x, inputs))

    def attend(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """Every head's attention output, concatenated ``(B, T, n_head * head_dim)``: all of
        attention but the output projection (tensor parallelism projects a slice of heads)."""
        B, T, _ = x.shape
        nh, nkv, hd = self.n_head, self.n_kv_head, self.head_dim
        q, k, v = self.c_attn(x).split([nh * hd, nkv * hd, nkv * hd], dim=2)
        q = q.view(B, T, nh, hd).transpose(1, 2)  # (B, nh, T, hd)
        k, v = (x.view(B, T, nkv, hd).transpose(1, 2) for x in (k, v))  # (B, nkv, T, hd)
        if inputs.rotation is not None:  # rotary positions: turn q and k, then cache k turned
            cos, sin = inputs.rotation  # (B, 1, T, hd/2) each
            q, k = rotate(self.q_norm(q), cos, sin), rotate(self.k_norm(k), cos, sin)
        if inputs.packed:  # rows of any lengths packed in one sequence: the cache keeps them apart
            y = inputs.cache.attend(self.layer_idx, q, k, v)  # (1, nh, N, hd)
            return y.transpose(1, 2).reshape(B, T, nh * hd)
        if inputs.cache is not None:
            k, v = inputs.cache.update(self.layer_idx, k, v)  # (B, nkv, S, hd): all cached tokens
        if nkv != nh and T == 1:  # grouped-query decode: each K/V head's nh // nkv query heads
            q = q.reshape(B, nkv, nh // nkv, hd)  # attend as its rows, reading the cache once
        elif nkv != nh:  # grouped-query prefill: each K/V head copied for its nh // nkv query heads
            k, v = (x.repeat_interleave(nh // nkv, dim=1) for x in (k, v))
        y = self.scores_times_values(q, k, v, inputs)  # (B, nh, T, hd) or, grouped, (B, nkv, nh // nkv, hd)
        return y.reshape(B, nh, T, hd).transpose(1, 2).reshape(B, T, nh * hd)  # (B, T, nh * hd)

    def scores_times_values(self, q, k, v, inputs: AttentionInputs) -> torch.Tensor:
        """softmax(q kᵀ / √hd) v, each query over the keys its mask allows. A left-padded batch
        goes row by row over each row's own slots (`AttentionInputs.rows`): its call alone."""
        sdpa = _attention_math if self.impl == "math" else F.scaled_dot_product_attention
        T = inputs.positions.shape[1]
        if T == 1 and sdpa is not _attention_math and (inputs.mask is None or inputs.rows):
            return hooks.decode_attention(q, k, v, inputs.rows)  # a decode step, row as alone
        if inputs.rows is None:
            return sdpa(q, k, v, inputs.mask, is_causal=inputs.is_causal)
        y = torch.zeros_like(q)  # padding queries: zeros, unread
        offset = k.shape[2] - T  # slots cached before the new tokens
        for b, s in enumerate(inputs.rows):  # row b's real slots: s.., its real queries: qs..
            qs = max(s - offset, 0)
            mask = None if offset == 0 or T == 1 else inputs.mask[b:b + 1, :, qs:, s:]
            y[b:b + 1, :, qs:] = sdpa(q[b:b + 1, :, qs:], k[b:b + 1, :, s:], v[b:b + 1, :, s:],
                                      mask, is_causal=offset == 0 and T - qs > 1)
        return y


def _attention_math(q, k, v, mask, is_causal):
    """softmax(Q Kᵀ / √hd) V written out: builds the full (T, S) score matrix per head."""
    scores = (q @ k.transpose(-2, -1)) / math.sqrt(q.shape[-1])  # (B, nh, T, S)
    if is_causal:
        t, s = scores.shape[-2:]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask is not None:  # additive: 0 where allowed, -inf where not
        scores = scores + mask
    return scores.softmax(dim=-1) @ v


class MLP(nn.Module):
    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, config.mlp_hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))  # GPT-2's GELU


class GatedMLP(MLP):
    """Llama's SwiGLU MLP: ``down(silu(gate(x)) * up(x))``. The gate and up projections are one
    fused `c_fc` (gate rows first, then up rows): one matrix product instead of two."""

    def __init__(self, config: GPTConfig) -> None:
        nn.Module.__init__(self)
        self.c_fc = nn.Linear(config.n_embd, 2 * config.mlp_hidden, bias=config.bias)
        self.c_proj = nn.Linear(config.mlp_hidden, config.n_embd, bias=config.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.c_fc(x).chunk(2, dim=-1)  # (B, T, hidden) each
        return self.c_proj(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer_idx: int) -> None:
        super().__init__()
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, layer_idx)
        self.ln_2 = make_norm(config)
        self.mlp = GatedMLP(config) if config.mlp == "swiglu" else MLP(config)

    def forward(self, x: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), inputs)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2-family decoder. ``model(ids)`` → logits ``(B, T, vocab)``.

    With ``cache=...`` the new tokens' K/V are written into the cache and attention reads all
    cached tokens (prefill: many new tokens; decode: one); without, the whole sequence is
    recomputed (the KV-cache lesson's reference). The cached, recomputed, chunked and left-padded
    paths agree to float rounding in fp32 (1e-5: the same greedy tokens), in bf16/fp16 to that
    dtype's precision (a near-tie can flip; tests/test_exactness.py)."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        learned = config.positions == "learned"  # GPT-2's position table; rotary: in attention
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.context_length, config.n_embd) if learned else None,
            h=nn.ModuleList(Block(config, i) for i in range(config.n_layer)),
            ln_f=make_norm(config),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        # Llama/Qwen: rotary positions, applied in every layer's attention (no parameters)
        self.rotary = RotaryEmbedding(config) if config.positions == "rope" else None
        if config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        hooks.lay_out_weights(self)  # the speed-up seam: `minifer.fast.layout`

    # ---- construction -------------------------------------------------------------------
    @classmethod
    def from_config(cls, config: GPTConfig | str, *, seed: int = 0,
                    device: torch.device | str | None = None, dtype: torch.dtype | None = None
                    ) -> GPT:
        """A randomly initialised model (GPT-2 init, seeded: same seed → same weights anywhere)."""
        if isinstance(config, str):
            config = GPTConfig.preset(config)
        if device is not None and as_device(device).type == "meta":  # shapes only, no memory:
            with torch.device("meta"):  # the size of a 70B model, say, without its weights
                return cls(config).ready(dtype=dtype)
        with torch.device("cpu"):
            model = cls(config)
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                std = 0.02 / math.sqrt(2 * config.n_layer) if name.endswith("c_proj.weight") else 0.02
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):  # GPT-2 init: zero biases (not torch's random default)
                with torch.no_grad():
                    p.zero_()
        return model.ready(None if device is None else as_device(device), dtype)

    @classmethod
    def from_hf(cls, hf_model) -> GPT:
        """Import a `transformers` model already in memory (no download here): a
        `GPT2LMHeadModel`, `LlamaForCausalLM`, `Qwen2ForCausalLM` or `Qwen3ForCausalLM`,
        converted exactly or refused as a folder is (`minifer.hf_convert`)."""
        from .hf_convert import FAMILIES

        hc = getattr(hf_model, "config", None)
        if not isinstance(hf_model, nn.Module) or getattr(hc, "model_type", None) not in FAMILIES \
                or not hasattr(hf_model, "lm_head"):
            raise TypeError(f"hf_model must be a transformers GPT2LMHeadModel, LlamaForCausalLM, "
                            f"Qwen2ForCausalLM or Qwen3ForCausalLM, got {type(hf_model).__name__}")
        state = {k: v.detach().clone() for k, v in hf_model.state_dict().items()}  # ours to keep
        return cls.from_hf_state(hc.to_dict(), state, next(hf_model.parameters()).dtype)

    @classmethod
    def from_hf_state(cls, hc: dict, tensors: dict[str, torch.Tensor],
                      dtype: torch.dtype | None = None, device: torch.device | None = None) -> GPT:
        """A model (eval mode, on `device`) from a Hugging Face config dict (``config.json``) and
        its tensors by Hugging Face names, which it takes over (no copy where the dtype is already
        `dtype`; default: the tensors' own). A tensor missing, left over or of another shape than the
        config implies is a ValueError naming it."""
        from .hf_convert import config_from_hf, state_from_hf

        dtype = dtype or next(iter(tensors.values())).dtype
        config = config_from_hf(hc, dtype)
        state = state_from_hf(tensors, config, hc["model_type"])
        with torch.device("meta"):  # shapes only: the checkpoint's tensors are assigned below
            model = cls(config)
        expected = {k: tuple(v.shape) for k, v in model.state_dict().items()
                    if not (config.tie_embeddings and k == "lm_head.weight")}
        for name in sorted(set(expected) | set(state)):
            got = tuple(state[name].shape) if name in state else None
            if got != expected.get(name):
                raise ValueError(f"Hugging Face checkpoint: {name} has shape {got}, the config "
                                 f"implies {expected.get(name)}")
        model.take_weights({k: v.detach().to(dtype) for k, v in state.items()})
        return model.ready(device)

    def take_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Make `state`'s tensors this model's weights, without a copy (a tied model's state
        may leave out ``lm_head.weight``), then lay them out as a new model's are."""
        if self.config.tie_embeddings:
            state["lm_head.weight"] = state["transformer.wte.weight"]
        self.load_state_dict(state, strict=True, assign=True)
        if self.config.tie_embeddings:
            self.lm_head.weight = self.transformer.wte.weight
        hooks.lay_out_weights(self)  # the speed-up seam, as for a model built from a config

    def ready(self, device: torch.device | None = None, dtype: torch.dtype | None = None) -> GPT:
        """This model on `device` in `dtype` (None: as it is), in eval mode; bf16 weights are
        handed to the speed-ups as `quantize(model, "bf16")` hands them (`hooks.prepare_bf16`).
        Every way of making a model ends here."""
        model = self.to(device=device, dtype=dtype).eval()
        if self.lm_head.weight.dtype == torch.bfloat16:
            hooks.prepare_bf16(model)
        return model

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def set_attention(self, impl: str) -> None:
        """Switch every layer between fused `"sdpa"` attention and the explicit `"math"` version."""
        if impl not in ("sdpa", "math"):
            raise ValueError(f"impl must be 'sdpa' or 'math', got {impl!r}")
        for block in self.transformer.h:
            block.attn.impl = impl

    # ---- forward -----------------------------------------------------------------------
    def forward(self, idx: torch.Tensor, cache: KVCache | PackedKVCache | AttentionInputs | None = None,
                start: torch.Tensor | None = None, last_only: bool = False) -> torch.Tensor:
        """Logits ``(B, T, vocab)`` for token ids `idx` ``(B, T)`` (``(B, 1, vocab)`` with
        `last_only`, all a prefill needs). `cache`: write the new K/V at slots ``cache.pos..``
        and attend over every cached slot; a packed cache runs `forward_packed`; the layers'
        `AttentionInputs`, built and checked by the caller (the speed-ups' decode step), may
        stand in its place. `start` (no cache): each row's count of left-padding tokens."""
        if getattr(cache, "packed", False):
            return self.forward_packed(idx, cache)
        if isinstance(cache, AttentionInputs):
            inputs, cache = cache, None  # the caller advances its cache
        else:
            self.check_input(idx, cache)
            inputs = _inputs(idx, cache, start)
        x = self.blocks(idx, inputs)  # (B, T, C)
        if cache is not None:
            cache.advance(idx.shape[1])
        x = x[:, -1:, :] if last_only else x  # (B, 1, C) with last_only
        return self.lm_head(self.transformer.ln_f(x))  # (B, T or 1, vocab)

    def check_input(self, idx: torch.Tensor, cache: KVCache | None) -> None:
        """A ValueError for token ids the model cannot take (`_refuse_input` says why)."""
        offset = 0 if cache is None else cache.pos  # slots already cached
        ok = idx.dim() == 2 and idx.dtype in (torch.int64, torch.int32) and 0 not in idx.shape
        end = offset + idx.shape[-1] if ok else 0  # slots cached after this call
        ok = ok and end <= self.config.context_length
        ok = ok and (cache is None or (idx.shape[0] == cache.batch_size and end <= cache.max_len))
        if ok and _checks_ids(idx.device.type, offset == 0):
            lo, hi = (t.item() for t in torch.aminmax(idx))  # one reduction (~5 µs on a CPU)
            ok = 0 <= lo and hi < self.config.vocab_size
        if not ok:
            _refuse_input(self.config, idx, cache)

    def forward_packed(self, idx: torch.Tensor, cache: PackedKVCache) -> torch.Tensor:
        """Logits ``(len(cache.logits_index), vocab)`` for rows packed end to end in `idx`
        ``(1, N)`` (a serving step, `engine.kv_pool.PackedBatch`): token-wise layers run once
        over all N tokens, ``cache.attend`` keeps each row to its own tokens."""
        if idx.dim() != 2 or idx.shape[0] != 1 or idx.shape[1] != cache.num_tokens:
            raise ValueError(f"a packed call takes idx of shape (1, {cache.num_tokens}), got "
                             f"{tuple(idx.shape)}")
        if _checks_ids(idx.device.type, False):
            lo, hi = (t.item() for t in torch.aminmax(idx))
            if lo < 0 or hi >= self.config.vocab_size:
                raise ValueError(f"idx must hold token ids in [0, {self.config.vocab_size}) "
                                 f"(the vocabulary), got {lo if lo < 0 else hi}")
        if int(cache.positions.max()) >= self.config.context_length:
            raise ValueError(f"a row reaches position {int(cache.positions.max())}, beyond the "
                             f"context window ({self.config.context_length})")
        x = self.blocks(idx, AttentionInputs(cache.positions, cache=cache, packed=True))
        x = x[0].index_select(0, cache.logits_index)  # (rows, C)
        return self.lm_head(self.transformer.ln_f(x))  # (rows, vocab)

    def blocks(self, idx: torch.Tensor, inputs: AttentionInputs) -> torch.Tensor:
        """Embed token ids `idx` ``(B, T)`` at ``inputs.positions`` and run every block: the
        hidden states ``(B, T, C)`` before the final LayerNorm."""
        x = self.transformer.wte(idx)  # (B, T, C)
        if self.transformer.wpe is not None:  # learned positions (GPT-2): added to the input
            x = x + self.transformer.wpe(inputs.positions)
        else:  # rotary positions: every layer turns q and k by the same angles, computed here
            inputs.rotation = self.rotary(inputs.positions, x.dtype)
        for block in self.transformer.h:
            x = block(x, inputs)
        return x


def _refuse_input(config: GPTConfig, idx: torch.Tensor, cache: KVCache | None) -> None:
    """The ValueError for ids `GPT.check_input` refused: not ``(B, T)`` integers, empty, past
    the context window, not fitting `cache`, or outside the vocabulary."""
    if idx.dim() != 2 or idx.dtype not in (torch.int64, torch.int32) or 0 in idx.shape:
        raise ValueError(f"idx must be a non-empty (batch, tokens) tensor of int64/int32 "
                         f"token ids, got {idx.dtype} of shape {tuple(idx.shape)}")
    B, T = idx.shape
    offset = 0 if cache is None else cache.pos
    if offset + T > config.context_length:
        raise ValueError(f"sequence of {offset + T} tokens exceeds the context window "
                         f"({config.context_length})")
    if cache is not None and B != cache.batch_size:
        raise ValueError(f"batch of {B} rows does not match the cache's "
                         f"batch_size={cache.batch_size}")
    if cache is not None:
        cache.check_room(T)
    lo, hi = (t.item() for t in torch.aminmax(idx))
    raise ValueError(f"idx must hold token ids in [0, {config.vocab_size}) (the vocabulary), "
                     f"got {lo if lo < 0 else hi}")


def _checks_ids(device_type: str, fresh: bool) -> bool:
    """Whether to range-check token ids: always on the CPU; on an accelerator (the read makes
    the host wait) only for calls that start a sequence (later ids are the engine's own)."""
    return device_type == "cpu" or (fresh and device_type != "meta")


def _inputs(idx: torch.Tensor, cache: KVCache | None, start: torch.Tensor | None
            ) -> AttentionInputs:
    """Position ids, attention mask, causal flag (and padded rows' starts) for the T new tokens
    `idx` ``(B, T)`` at slots ``offset..``, after the `offset` tokens `cache` holds. Unpadded,
    a fresh prefill is causal and a one-token step sees every cached slot: no mask. Else query
    slot i of row b sees key slot j if ``start[b] <= j <= i``, and always itself (no NaNs)."""
    (B, T), device = idx.shape, idx.device
    offset = 0 if cache is None else cache.pos
    start = start if cache is None else cache.start if cache.padded else None  # cache: its own
    q_slots = torch.arange(offset, offset + T, device=device)  # (T,)
    if start is None and (offset == 0 or T == 1):
        pos = q_slots.unsqueeze(0).expand(B, T)  # (B, T)
        return AttentionInputs(pos, None, offset == 0 and T > 1, cache)
    rows = None if start is None or start.is_meta else start.tolist()  # padded: row by row
    start = torch.zeros(B, dtype=torch.long, device=device) if start is None else start.to(device)
    pos = (q_slots[None, :] - start[:, None]).clamp(min=0)  # (B, T) per-row positions
    k_slots = torch.arange(offset + T, device=device)  # (S,)
    causal = k_slots[None, :] <= q_slots[:, None]  # (T, S)
    real = k_slots[None, :] >= start[:, None]  # (B, S)
    self_ = k_slots[None, :] == q_slots[:, None]  # (T, S)
    mask = (causal[None] & real[:, None, :]) | self_[None]  # (B, T, S)
    return AttentionInputs(pos, mask.unsqueeze(1), False, cache, rows=rows)  # mask (B, 1, T, S)


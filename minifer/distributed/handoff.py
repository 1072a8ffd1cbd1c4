"""A prefilled request handed from one engine to another, and its wire format over torch.distributed.

Disaggregated serving (claim PD-12): :func:`export_prefilled` takes a request whose first token
was sampled out of the *prefill* engine as a :class:`Handoff` (with exactly the prompt tokens'
K/V); :func:`add_prefilled` writes it into the *decode* engine's pool to continue there.

On the wire (:func:`send_handoff` / :func:`recv_handoff`, point-to-point, gloo or NCCL) a
handoff is three messages, few because each is a round trip:

1. four int64: kind (1 = a request, 0 = no more, 2 = a keep-alive: an idle receiver never
   meets the group's timeout), the metadata's length, prompt tokens with K/V, generator bytes;
2. the metadata (UTF-8 JSON) followed by the generator's state, one uint8 tensor;
3. the K/V ``(n_layer, 2, prompt tokens, kv_heads, head_dim)``, if any (shape from the model)."""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field

import torch

from ..sampling import SamplingParams

__all__ = ["Handoff", "export_prefilled", "add_prefilled", "finished_handoff", "params_to_dict",
           "params_from_dict", "send_handoff", "send_done", "send_alive", "recv_handoff"]

_REQUEST, _DONE, _ALIVE = 1, 0, 2


def params_to_dict(params: SamplingParams) -> dict:
    """`params` as JSON-able keyword arguments of `SamplingParams` (logit_bias keys as strings)."""
    d = dataclasses.asdict(params)
    d["stop"] = list(params.stop)
    d["logit_bias"] = {str(k): v for k, v in params.logit_bias.items()}
    return d


def params_from_dict(d: dict) -> SamplingParams:
    """The inverse of :func:`params_to_dict`."""
    d = dict(d)
    d["stop"] = tuple(d.get("stop", ()))
    d["logit_bias"] = {int(k): v for k, v in d.get("logit_bias", {}).items()}
    return SamplingParams(**d)


@dataclass
class Handoff:
    """A request whose prompt is computed and whose first token is sampled, ready to decode.

    `kv`: the prompt's K/V, ``(n_layer, 2, len(prompt_ids), kv_heads, head_dim)``, or None when
    the first token finished the request. Times are ``time.perf_counter()`` seconds (one clock
    for every process of a Linux machine)."""

    request_id: str
    prompt_ids: list[int]
    first_token: int | None  # None: the request failed before its first token
    params: SamplingParams
    kv: torch.Tensor | None
    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finish_reason: str | None = None
    priority: int = 0
    generator_state: torch.Tensor | None = field(default=None, repr=False)
    error: str | None = None  # why it failed (finish_reason "error")
    # accounting, filled in by the wire functions
    kv_bytes: int = 0  # bytes of K/V sent or received
    transfer_s: float = 0.0  # seconds inside send (sender) or recv of the K/V (receiver)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    def meta(self) -> dict:
        """Everything but the tensors, as JSON-able values."""
        return {"request_id": self.request_id, "prompt_ids": self.prompt_ids,
                "first_token": self.first_token, "params": params_to_dict(self.params),
                "arrival_time": self.arrival_time,
                "first_scheduled_time": self.first_scheduled_time,
                "first_token_time": self.first_token_time, "finish_reason": self.finish_reason,
                "priority": self.priority, "error": self.error}


def export_prefilled(engine, request_id: str) -> Handoff:
    """Take a request out of `engine` right after the step of its first token, with a copy of
    its prompt's K/V (one the first token finished: :func:`finished_handoff`)."""
    req = engine.get_request(request_id)
    if req is None:
        raise KeyError(f"no unfinished request {request_id!r} in this engine")
    prompt = req.seq.prompt_ids
    if len(req.seq.output_ids) != 1 or req.num_computed != len(prompt):
        raise ValueError(f"request {request_id!r} is not just prefilled: {len(prompt)} prompt "
                         f"tokens, {req.num_computed} computed, {len(req.seq.output_ids)} "
                         f"sampled (export it right after the step of its first token)")
    kv = engine.pool.read_tokens(engine.block_table(request_id), len(prompt))
    m = req.metrics
    state = req.generator.get_state() if req.generator is not None else None
    engine.abort(request_id)  # frees its blocks
    return Handoff(request_id, list(prompt), req.seq.output_ids[0], req.params, kv,
                   m.arrival_time, m.first_scheduled_time, m.first_token_time,
                   priority=req.priority, generator_state=state)


def finished_handoff(out, params: SamplingParams) -> Handoff:
    """A K/V-less handoff for a request that ended by its first token; `out`: its last output."""
    m = out.metrics
    return Handoff(out.request_id, list(out.prompt_token_ids),
                   out.token_ids[0] if out.token_ids else None, params, None, m.arrival_time,
                   m.first_scheduled_time, m.first_token_time, finish_reason=out.finish_reason,
                   error=out.error)


def add_prefilled(engine, handoff: Handoff) -> bool:
    """Continue in `engine` (an `LLMEngine`) a request another engine prefilled: allocate
    blocks, write the prompt's K/V, decode it from the next step (keeping the prefill
    engine's timestamps). False, changing nothing, when it does not fit now; a ValueError for a
    handoff that could never run here, one already finished, or K/V of the wrong shape."""
    h, pool = handoff, engine.pool
    if h.finish_reason is not None or h.kv is None:
        raise ValueError(f"request {h.request_id!r} finished at its first token "
                         f"({h.finish_reason}); there is nothing to decode")
    expect = (pool.n_layer, 2, len(h.prompt_ids), pool.n_kv_head, pool.head_dim)
    if tuple(h.kv.shape) != expect:
        raise ValueError(f"handoff K/V has shape {tuple(h.kv.shape)}, this engine's model "
                         f"needs {expect}")
    if not engine.scheduler.can_admit([*h.prompt_ids, h.first_token]):
        return False  # checked first: a request waiting for room is not prepared again
    req = engine.new_request(list(h.prompt_ids), h.params, h.request_id, h.priority, h.arrival_time)
    if req.generator is not None and h.generator_state is not None:
        req.generator.set_state(h.generator_state)
    if req.seen is not None:
        req.seen[h.first_token] = True
    req.metrics.on_scheduled(h.first_scheduled_time)
    got = engine.add_prefilled(req, h.first_token, h.first_token_time)
    if got is None:
        return False
    cached, out = got
    if out.finished:
        raise ValueError(f"request {h.request_id!r}: its first token finishes it "
                         f"({out.finish_reason}); there is nothing to decode")
    if cached < len(h.prompt_ids):
        pool.write_tokens(engine.block_table(h.request_id), h.kv[:, :, cached:], start=cached)
    return True


def _send(t: torch.Tensor, dst: int, group) -> None:
    import torch.distributed as dist

    dist.send(t.contiguous(), dst, group=group)


def send_handoff(h: Handoff, dst: int, *, device: torch.device | str = "cpu",
                 group=None) -> Handoff:
    """Send `h` to rank `dst` (header, metadata, generator state, K/V); returns `h` with
    `kv_bytes` and `transfer_s` (the time inside the K/V's send) filled in."""
    meta = torch.frombuffer(bytearray(json.dumps(h.meta()).encode()), dtype=torch.uint8)
    state = h.generator_state
    tokens = 0 if h.kv is None else h.kv.shape[2]
    header = torch.tensor([_REQUEST, meta.numel(), tokens, 0 if state is None else state.numel()],
                          dtype=torch.int64)
    _send(header.to(device), dst, group)
    blob = meta if state is None else torch.cat([meta, state.to(torch.uint8).flatten()])
    _send(blob.to(device), dst, group)
    h.kv_bytes, h.transfer_s = 0, 0.0
    if h.kv is not None:
        kv = h.kv.to(device).contiguous()
        t0 = time.perf_counter()
        _send(kv, dst, group)
        h.transfer_s = time.perf_counter() - t0
        h.kv_bytes = kv.numel() * kv.element_size()
    return h


def send_done(dst: int, *, device: torch.device | str = "cpu", group=None) -> None:
    """Tell rank `dst` that no more handoffs will come."""
    _send(torch.tensor([_DONE, 0, 0, 0], dtype=torch.int64, device=device), dst, group)


def send_alive(dst: int, *, device: torch.device | str = "cpu", group=None) -> None:
    """Tell rank `dst` that this rank is idle but alive (the receiver skips it)."""
    _send(torch.tensor([_ALIVE, 0, 0, 0], dtype=torch.int64, device=device), dst, group)


def recv_handoff(src: int, kv_shape: tuple[int, int, int], dtype: torch.dtype, *,
                 device: torch.device | str = "cpu", group=None) -> Handoff | None:
    """Receive one handoff from rank `src`; None when `src` sent :func:`send_done`.
    `kv_shape`: the model's ``(n_layer, kv_heads, head_dim)``, `dtype` its K/V dtype.
    `transfer_s` times the K/V's recv only, not the wait for the header."""
    import torch.distributed as dist

    header = torch.zeros(4, dtype=torch.int64, device=device)
    while True:
        dist.recv(header, src, group=group)
        kind, meta_len, tokens, state_len = (int(x) for x in header.tolist())
        if kind != _ALIVE:
            break
    if kind == _DONE:
        return None
    if kind != _REQUEST:
        raise RuntimeError(f"unexpected handoff header {header.tolist()} from rank {src}")
    blob = torch.zeros(meta_len + state_len, dtype=torch.uint8, device=device)
    dist.recv(blob, src, group=group)
    blob = blob.cpu()
    m = json.loads(blob[:meta_len].numpy().tobytes().decode())
    state = blob[meta_len:].clone() if state_len else None
    kv, nbytes, seconds = None, 0, 0.0
    if tokens:
        n_layer, kv_heads, head_dim = kv_shape
        kv = torch.empty((n_layer, 2, tokens, kv_heads, head_dim), dtype=dtype, device=device)
        t0 = time.perf_counter()
        dist.recv(kv, src, group=group)
        seconds = time.perf_counter() - t0
        nbytes = kv.numel() * kv.element_size()
    meta = dict(m, params=params_from_dict(m["params"]))  # what `Handoff.meta` sent
    return Handoff(**meta, kv=kv, generator_state=state, kv_bytes=nbytes, transfer_s=seconds)

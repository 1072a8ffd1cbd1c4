"""`DisaggregatedEngine`: one front for a prefill process and a decode process.

The front, in the caller's process, starts the two ranks (`Workers`), checks each request as
`LLMEngine.add_request` would, writes it to rank 0's stdin as a JSON line and reads finished
requests from rank 1's stdout on a thread; a failed rank ends both (`WorkerError`)."""

from __future__ import annotations

import contextlib
import json
import queue
import tempfile
import threading
import time
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ...checks import check_int, check_number
from ...config import kv_token_bytes
from ...engine.metrics import RequestMetrics
from ...engine.options import generate_arguments, prepare_request
from ...pretrained import load_pretrained, save_checkpoint
from ...sampling import SamplingParams
from ...sequence import check_model
from ...tokenizer import Tokenizer
from ..handoff import params_to_dict
from ..parallel.launch import WorkerError, Workers, worker_model
from .worker import FAULT_ENV

__all__ = ["DisaggOutput", "DisaggReport", "DisaggregatedEngine", "FAULT_ENV"]

@dataclass
class DisaggOutput:
    """A finished request: its tokens, its metrics and the K/V it moved between the processes."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    finish_reason: str
    metrics: RequestMetrics
    kv_bytes: int  # K/V bytes received by the decode worker (0: finished at its first token)
    recv_s: float  # seconds inside the decode worker's recv of those bytes
    preemptions: int  # times the decode worker preempted it (it recomputed there)
    text: str | None = None
    error: str | None = None  # why it failed (finish_reason "error"), naming the request

    @property
    def finished(self) -> bool:
        return True


@dataclass
class DisaggReport:
    """What both workers did: their step timelines and every transfer (seconds, bytes)."""

    bytes_per_token: int  # K/V bytes per token, all layers (`PagedKVPool.bytes_per_token`)
    prefill: dict = field(repr=False)  # rank 0's report: "timeline", "transfers", ...
    decode: dict = field(repr=False)  # rank 1's report: "timeline", "recv", "preemptions", ...
    pids: list[int] = field(default_factory=list)

    @property
    def kv_bytes(self) -> int:
        """K/V bytes sent by rank 0 in all."""
        return sum(t["kv_bytes"] for t in self.prefill["transfers"])

    @property
    def transfers(self) -> list[dict]:
        """One per request: request_id, prompt_tokens, kv_bytes, send_s."""
        return self.prefill["transfers"]


class DisaggregatedEngine:
    """Prefill on one process, decode on another, one `LLMEngine`-like front.

    - `model`: a `GPT` in memory (saved for the workers) or a shipped model's name.
    - `block_size`: both pools'; `prefill_tokens`, `prefill_max_seqs`: rank 0's step budget and
      prompts in flight; `decode_blocks`, `decode_max_seqs`, `decode_tokens`: rank 1's pool,
      batch and step budget (a small pool preempts: the request recomputes on rank 1).
    - `threads`: torch threads per worker; `timeout_s`: how long any wait may take;
      `prefill_nice`: the prefill worker's ``os.nice``; `keepalive_s`: how often an idle prefill
      worker says it is alive (default: a quarter of `timeout_s`, at most 10 s).
    - `fault`: tests only — ``"prefill:N"`` / ``"decode:N"`` makes that worker fail at step N.

    A context manager (or :meth:`close`); no stop strings (the workers have no tokenizer)."""

    def __init__(self, model: torch.nn.Module | str, tokenizer=None, *, block_size: int = 16,
                 prefill_tokens: int = 128, prefill_max_seqs: int = 8,
                 decode_blocks: int | None = None, decode_max_seqs: int = 32,
                 decode_tokens: int | None = None, threads: int = 1, timeout_s: float = 120.0,
                 prefill_nice: int = 0, keepalive_s: float | None = None,
                 fault: str | None = None) -> None:
        self.name, self.model, self.tokenizer, self.dtype = _front_model(model, tokenizer)
        cfg = self.model.config
        for name, value in (("block_size", block_size), ("prefill_tokens", prefill_tokens),
                            ("prefill_max_seqs", prefill_max_seqs),
                            ("decode_max_seqs", decode_max_seqs), ("threads", threads)):
            check_int(name, value, 1)
        if decode_blocks is None:
            decode_blocks = decode_max_seqs * -(-cfg.context_length // block_size)
        check_int("decode_blocks", decode_blocks, 1)
        decode_tokens = cfg.context_length if decode_tokens is None else decode_tokens
        check_int("decode_tokens", decode_tokens, 1)
        check_number("timeout_s", timeout_s, gt=0)
        check_int("prefill_nice", prefill_nice, 0, 19)
        if keepalive_s is not None:
            check_number("keepalive_s", keepalive_s, gt=0)
        if fault is not None and (not isinstance(fault, str) or fault.split(":")[0] not in
                                  ("prefill", "decode")):
            raise ValueError(f"fault must be 'prefill:N' or 'decode:N', got {fault!r}")
        self.block_size, self.decode_blocks = block_size, decode_blocks
        self.bytes_per_token = kv_token_bytes(cfg.n_layer, cfg.kv_heads, cfg.head_dim,
                                              next(self.model.parameters()).element_size())
        self.options = {"--block-size": block_size, "--prefill-tokens": prefill_tokens,
                        "--prefill-max-seqs": prefill_max_seqs, "--decode-blocks": decode_blocks,
                        "--decode-max-seqs": decode_max_seqs, "--decode-tokens": decode_tokens,
                        "--prefill-nice": prefill_nice}
        if keepalive_s is not None:
            self.options["--keepalive"] = keepalive_s
        self.threads, self.timeout_s, self.fault = threads, float(timeout_s), fault
        self.workers: Workers | None = None
        self.report: DisaggReport | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._events: queue.Queue = queue.Queue()
        self._unfinished: set[str] = set()
        self._done: dict[str, DisaggOutput] = {}
        self._reports: dict[str, dict] = {}
        self._ids = 0
        self._closed = False

    # ---- processes -----------------------------------------------------------------------
    def start(self) -> DisaggregatedEngine:
        """Start both workers (``generate`` and the context manager call this)."""
        if self.workers is not None:
            return self
        if self._closed:
            raise RuntimeError("this DisaggregatedEngine is closed; make a new one")
        self._tmp = tempfile.TemporaryDirectory(prefix="minifer-disagg-")
        tmp = Path(self._tmp.name)
        name = self.name or str(save_checkpoint(self.model, tmp / "model.safetensors"))
        args = ["--front", "--model", name, "--device", "cpu", "--threads", str(self.threads),
                "--timeout", str(self.timeout_s), "--dtype", self.dtype]
        for k, v in self.options.items():
            args += [k, str(v)]
        if self.tokenizer is not None:
            args += ["--vocab", str(self.tokenizer.vocab_size)]
        # "" means no fault, also where this process's environment has one set
        self.workers = Workers([args, args], tmp, module="minifer.distributed.disagg",
                               threads=self.threads, pipes=True, what="disaggregated serving",
                               extra_env={FAULT_ENV: self.fault or ""})
        # An engine dropped without close() still ends its workers when it is collected.
        weakref.finalize(self, self.workers.end)
        for rank, proc in enumerate(self.workers.procs):
            threading.Thread(target=_read_lines, args=(self._events, rank, proc.stdout),
                             daemon=True).start()
        return self

    def __enter__(self) -> DisaggregatedEngine:
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        else:
            self.shutdown()

    def shutdown(self) -> None:
        """End both workers now (no report); safe to call at any time, more than once."""
        if self.workers is not None:
            self.workers.end()
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None
        self._closed = True

    @property
    def pids(self) -> list[int]:
        return [] if self.workers is None else self.workers.pids

    # ---- requests --------------------------------------------------------------------------
    def add_request(self, prompt, params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    priority: int = 0) -> str:
        """Send one request (text with a tokenizer, or token ids) to the prefill worker, after
        `LLMEngine.add_request`'s own check (`prepare_request`) and the decode pool's: a
        ValueError for a request that could never run (or has stop strings)."""
        if self.report is not None or self._closed:
            raise RuntimeError("the engine is closed; no more requests")
        params = params or SamplingParams()
        seq, _ = prepare_request(self.model, self.tokenizer, prompt, params, priority=priority,
                                 arrival_time=arrival_time, request_id=request_id)
        if params.stop:
            raise ValueError("stop strings are not supported by the disaggregated engine (the "
                             "workers have no tokenizer); stop on max_new_tokens or eos")
        need = -(-seq.max_len // self.block_size)
        if need > self.decode_blocks:
            raise ValueError(f"request needs {need} blocks of {self.block_size} tokens but the "
                             f"decode pool has decode_blocks={self.decode_blocks}")
        if request_id is None:
            while f"req-{self._ids}" in self._unfinished or f"req-{self._ids}" in self._done:
                self._ids += 1
            request_id = f"req-{self._ids}"
            self._ids += 1
        if request_id in self._unfinished or request_id in self._done:
            raise ValueError(f"request_id {request_id!r} is already in use")
        self.start()
        arrival = time.perf_counter() if arrival_time is None else float(arrival_time)
        msg = {"op": "add", "request_id": request_id, "prompt_ids": seq.prompt_ids,
               "params": params_to_dict(params), "arrival_time": arrival, "priority": priority}
        self._send(msg)
        self._unfinished.add(request_id)
        return request_id

    def _send(self, msg: dict) -> None:
        stdin = self.workers.procs[0].stdin
        try:
            stdin.write((json.dumps(msg) + "\n").encode())
            stdin.flush()
        except (BrokenPipeError, OSError, ValueError):
            self._check()
            self.shutdown()
            raise WorkerError("the prefill worker stopped reading requests", self.pids) from None

    def has_unfinished(self) -> bool:
        return bool(self._unfinished)

    def _check(self) -> None:
        """Raise WorkerError (both workers ended) if one has failed."""
        try:
            self.workers.check()
        except WorkerError:
            self.shutdown()
            raise

    def poll(self, timeout_s: float = 0.0) -> list[DisaggOutput]:
        """Requests that finished since the last call (waiting up to `timeout_s` for one)."""
        self._check()
        got: list[DisaggOutput] = []
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                rank, ev = self._events.get(timeout=max(deadline - time.monotonic(), 0)
                                            if not got and timeout_s > 0 else 0.0001)
            except queue.Empty:
                break
            if ev is None:  # a worker's stdout closed: it exited
                self._wait_exit(rank)
                continue
            if ev["event"] == "finished":
                out = self._output(ev)
                self._unfinished.discard(out.request_id)
                self._done[out.request_id] = out
                got.append(out)
            elif ev["event"] == "report":
                self._reports[ev["role"]] = ev
        return got

    def _wait_exit(self, rank: int) -> None:
        with contextlib.suppress(Exception):  # whatever it was, `_check` reports it
            self.workers.procs[rank].wait(timeout=5)
        self._check()

    def _output(self, ev: dict) -> DisaggOutput:
        m = RequestMetrics(ev["request_id"], len(ev["prompt_ids"]), ev["arrival_time"],
                           first_scheduled_time=ev["first_scheduled_time"],
                           first_token_time=(ev["token_times"] or [None])[0],
                           token_times=list(ev["token_times"]), finished_time=ev["finished_time"],
                           finish_reason=ev["finish_reason"], preemptions=ev["preemptions"])
        text = self.tokenizer.decode(ev["token_ids"]) if self.tokenizer is not None else None
        return DisaggOutput(ev["request_id"], ev["prompt_ids"], ev["token_ids"],
                            ev["finish_reason"], m, ev["kv_bytes"], ev["recv_s"],
                            ev["preemptions"], text, ev.get("error"))

    def generate(self, prompts, params: SamplingParams | Sequence[SamplingParams] | None = None
                 ) -> list[DisaggOutput]:
        """Run `prompts` (texts or token-id lists) to completion; outputs in order."""
        prompts, params = generate_arguments(prompts, params)
        for p, sp in zip(prompts, params):  # check all before sending any
            prepare_request(self.model, self.tokenizer, p, sp)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        self.wait(ids)
        return [self._done[i] for i in ids]

    def wait(self, request_ids: Sequence[str] | None = None) -> None:
        """Block until the given requests (default: all sent) have finished, or `timeout_s`."""
        want = set(self._unfinished if request_ids is None else request_ids) - set(self._done)
        deadline = time.monotonic() + self.timeout_s
        while want - set(self._done):
            if time.monotonic() > deadline:
                self.shutdown()
                raise WorkerError(f"disaggregated serving timed out after {self.timeout_s:g} s "
                                  f"with {len(want - set(self._done))} requests unfinished",
                                  self.pids)
            self.poll(timeout_s=0.2)

    def close(self) -> DisaggReport:
        """No more requests: let both workers finish, end them, return (and keep) the report."""
        if self.report is not None:
            return self.report
        self.start()
        try:
            self._send({"op": "close"})
            deadline = time.monotonic() + self.timeout_s
            while len(self._reports) < 2:
                if time.monotonic() > deadline:
                    raise WorkerError(f"disaggregated serving did not finish within "
                                      f"{self.timeout_s:g} s of close()", self.pids)
                self.poll(timeout_s=0.2)
            self.workers.wait(max(deadline - time.monotonic(), 5.0))
        finally:
            pids = self.pids
            self.shutdown()
        pre, dec = self._reports["prefill"], self._reports["decode"]
        self.report = DisaggReport(pre["bytes_per_token"], pre, dec, pids)
        return self.report

    @property
    def outputs(self) -> list[DisaggOutput]:
        """Every finished request so far, in the order they finished."""
        return list(self._done.values())


def _front_model(model, tokenizer) -> tuple[str | None, torch.nn.Module, Tokenizer | None, str]:
    """`worker_model`, with the model itself: a shipped one loaded for the front's checks."""
    name, _config, tokenizer, dtype = worker_model(model, tokenizer)
    if name is not None:
        return name, load_pretrained(name)[0], tokenizer, dtype
    check_model(model)  # once here: `prepare_request` trusts the model it is given
    return None, model, tokenizer, dtype


def _read_lines(events: queue.Queue, rank: int, stream) -> None:
    """A worker's stdout, one JSON line at a time, into `events` (a thread; it holds no
    reference to the engine, so a dropped engine can be collected and end its workers)."""
    for line in stream:
        try:
            events.put((rank, json.loads(line)))
        except ValueError:
            continue  # not a protocol line
    events.put((rank, None))

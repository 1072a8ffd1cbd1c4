"""Run tensor-parallel generation as N local processes, from Python or a notebook.

A small `torchrun` for one machine: N copies of ``python -m minifer.distributed.parallel`` with
torchrun's environment, each rank's JSON report read back, and every process **always** ended
(on success, a failing rank, a timeout, Ctrl-C). Subprocesses, not `multiprocessing`, so it works
in a Jupyter kernel; the model travels as a safetensors checkpoint, never as a pickle."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from ...checks import check_int, check_number, max_threads
from ...config import GPTConfig
from ...pretrained import PRETRAINED, model_files, save_checkpoint
from ...sampling import SamplingParams
from ...sequence import encode_prompts
from ...tokenizer import Tokenizer
from ..handoff import params_to_dict
from .layers import shard_plan
from .runtime import PARENT_ENV, RankReport


class WorkerError(RuntimeError):
    """A rank failed (or the run timed out); `pids` are the processes, all ended by now."""

    def __init__(self, message: str, pids: list[int]) -> None:
        super().__init__(message)
        self.pids = pids


@dataclass
class TPResult:
    """The outcome of :func:`run_local`: the tokens (from rank 0) and every rank's report."""

    token_ids: list[list[int]]  # generated ids, one list per prompt
    reports: list[RankReport]  # one per rank, in rank order
    pids: list[int]  # the worker processes (all ended)
    wall_s: float  # the whole run, process start-up and model loading included
    text: list[str] | None = None  # decoded completions, when a tokenizer was known


def running(pids: list[int]) -> list[int]:
    """Those of `pids` that still exist as processes (after a run: none)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            continue
        except PermissionError:  # exists, owned by someone else (a recycled pid)
            pass
        alive.append(pid)
    return alive


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Workers:
    """N local processes started with torchrun's environment, watched and always ended.

    Rank ``r`` runs ``python -m MODULE *argv_per_rank[r]``, its stderr (and stdout unless
    `pipes`) in ``rankR.log`` in `logdir`. A context manager, or call :meth:`end` in a
    ``finally``; :meth:`check` raises :class:`WorkerError` with every failed rank's output."""

    def __init__(self, argv_per_rank: list[list[str]], logdir: str | Path, *,
                 module: str = "minifer.distributed.parallel", threads: int = 1, pipes: bool = False,
                 what: str = "tensor-parallel run", extra_env: dict[str, str] | None = None
                 ) -> None:
        world = len(argv_per_rank)
        if world < 1:
            raise ValueError("argv_per_rank must hold one argument list per rank (at least one)")
        check_int("threads", threads, 1, max_threads())
        self.what = what
        self.procs: list[subprocess.Popen] = []
        self.logs = []
        port = free_port()
        try:
            for rank, args in enumerate(argv_per_rank):
                env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world),
                           LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                           MASTER_PORT=str(port), OMP_NUM_THREADS=str(threads),
                           PYTHONUNBUFFERED="1", **{PARENT_ENV: str(os.getpid())},
                           **(extra_env or {}))
                log = open(Path(logdir) / f"rank{rank}.log", "w+b")  # noqa: SIM115 (closed in end)
                self.logs.append(log)
                self.procs.append(subprocess.Popen(
                    [sys.executable, "-m", module, *args], env=env, stderr=log,
                    stdout=subprocess.PIPE if pipes else log,
                    stdin=subprocess.PIPE if pipes else subprocess.DEVNULL))
        except BaseException:
            self.end()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc) -> None:
        self.end()

    def tail(self, rank: int, n: int = 3000) -> str:
        """The last `n` characters rank `rank` wrote to its log."""
        return _tail(self.logs[rank], n)

    def check(self) -> list[int | None]:
        """Each rank's exit code (None: still running); WorkerError if one failed, with every
        failed rank's output after a moment (one failure brings down the ranks waiting on it)."""
        codes = [p.poll() for p in self.procs]
        if any(c not in (None, 0) for c in codes):
            first = next(r for r, c in enumerate(codes) if c not in (None, 0))
            time.sleep(0.5)
            codes = [p.poll() for p in self.procs]
            failed = [first] + [r for r, c in enumerate(codes) if c not in (None, 0) and r != first]
            details = "\n".join(f"--- rank {r} (exit code {codes[r]}), last output:\n"
                                f"{self.tail(r, 1500)}" for r in failed)
            self.end()
            raise WorkerError(f"rank {first} of {len(self.procs)} exited with code "
                              f"{codes[first]}; failed ranks: {failed}\n{details}", self.pids)
        return codes

    def wait(self, timeout_s: float) -> None:
        """Wait until every rank has exited with code 0; WorkerError on a failure or timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(c == 0 for c in self.check()):
                return
            if time.monotonic() > deadline:
                message = (f"{self.what} timed out after {timeout_s:g} s; rank 0's output ends "
                           f"with:\n{self.tail(0)}")
                self.end()
                raise WorkerError(message, self.pids)
            time.sleep(0.05)

    def end(self, grace_s: float = 3.0) -> None:
        """Terminate, then kill, what still runs; reap it, close pipes and logs (idempotent)."""
        _end_all(self.procs, grace_s)
        for p in self.procs:
            for f in (p.stdin, p.stdout):
                if f is not None:
                    with contextlib.suppress(OSError):
                        f.close()
        for log in self.logs:
            log.close()  # (a no-op once closed)


def launch(args_per_rank: list[list[str]], *, threads: int = 1, timeout_s: float = 120.0,
           workdir: str | Path | None = None) -> list[int]:
    """Start ``python -m minifer.distributed.parallel --device cpu ARGS`` once per rank and wait
    for all to succeed: the pids, or :class:`WorkerError` with the failing rank's stderr (also
    past `timeout_s`). Every process is ended before this returns or raises."""
    check_number("timeout_s", timeout_s, gt=0)  # (`Workers` checks the ranks and threads)
    with tempfile.TemporaryDirectory(prefix="minifer-tp-") as tmp:
        argv = [["--device", "cpu", "--threads", str(threads), *args] for args in args_per_rank]
        with Workers(argv, workdir or tmp, threads=threads) as workers:
            workers.wait(timeout_s)
            return workers.pids


def _tail(log, n: int = 3000) -> str:
    if log.closed:
        return ""
    log.flush()
    log.seek(0)
    return log.read().decode(errors="replace")[-n:]


def _end_all(procs: list[subprocess.Popen], grace_s: float = 3.0) -> None:
    """Terminate every process still running, then kill what is left; reap them all."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(deadline - time.monotonic(), 0.01))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_local(model: torch.nn.Module | str, prompts, world_size: int = 2,
              params: SamplingParams | None = None, tokenizer=None, *, threads: int = 1,
              allow_uneven: bool = False, keep_logits: bool = False,
              timeout_s: float = 120.0) -> TPResult:
    """Tensor-parallel generation on `world_size` local CPU processes; returns a `TPResult`.

    `model`: a `GPT` in memory (saved for the workers) or a shipped model's name. `prompts`: a
    string, a list of strings (needs a tokenizer), token ids, or a list of those. `threads`:
    torch threads per process. Errors in the split are raised before any process starts."""
    params = params or SamplingParams()
    if params.stop or params.repetition_penalty != 1.0:
        raise ValueError("the tensor-parallel loop supports temperature, top_k, top_p, seed, "
                         "logit_bias and ignore_eos; not stop strings or repetition_penalty")
    name, config, tokenizer, dtype = worker_model(model, tokenizer)
    shard_plan(config, world_size, 0, allow_uneven=allow_uneven)  # fail fast, no processes
    ids = encode_prompts(prompts, tokenizer, config.vocab_size)
    request = {"prompts": ids, "params": params_to_dict(params)}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="minifer-tp-") as tmp:
        tmp = Path(tmp)
        if name is None:
            name = str(save_checkpoint(model, tmp / "model.safetensors"))
        (tmp / "request.json").write_text(json.dumps(request))
        args = ["--model", name, "--request", str(tmp / "request.json"),
                "--report", str(tmp / "rank{rank}.json"), "--timeout", str(timeout_s),
                "--dtype", dtype, *(["--allow-uneven"] if allow_uneven else []),
                *(["--keep-logits"] if keep_logits else [])]
        pids = launch([args] * world_size, threads=threads, timeout_s=timeout_s, workdir=tmp)
        reports = [RankReport.from_dict(json.loads((tmp / f"rank{r}.json").read_text()))
                   for r in range(world_size)]
    text = None if tokenizer is None else [tokenizer.decode(t) for t in reports[0].token_ids]
    return TPResult(token_ids=reports[0].token_ids, reports=reports, pids=pids,
                    wall_s=time.perf_counter() - t0, text=text)


DTYPE_NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
"""The weight dtypes a worker runs, by their ``--dtype`` names."""


def worker_model(model: torch.nn.Module | str, tokenizer=None
                 ) -> tuple[str | None, GPTConfig, Tokenizer | None, str]:
    """``(shipped model's name or None, config, tokenizer, dtype name)`` of a `GPT` or a shipped
    model's name, for workers to load; a TypeError or ValueError for one they cannot run."""
    if isinstance(model, str):
        if model not in PRETRAINED:
            raise ValueError(f"model must be a GPT or one of {sorted(PRETRAINED)}, got {model!r}")
        _weights, config_path, tok_path = model_files(model)
        config = GPTConfig.from_dict(json.loads(config_path.read_text())["config"])
        tokenizer = Tokenizer.from_file(tok_path) if tokenizer is None else tokenizer
        return model, config, tokenizer, "fp32"
    if not (isinstance(model, torch.nn.Module)
            and isinstance(getattr(model, "config", None), GPTConfig)):
        raise TypeError(f"model must be a minifer GPT or a shipped model's name, got "
                        f"{type(model).__name__}")
    dtype = next(model.parameters()).dtype
    if dtype not in DTYPE_NAMES:
        raise ValueError(f"model weights must be fp32, bf16 or fp16, got {dtype}")
    return None, model.config, tokenizer, DTYPE_NAMES[dtype]

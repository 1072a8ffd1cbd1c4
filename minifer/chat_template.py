"""Chat prompts: a checkpoint's own chat template, or the play-form template of the shipped models.

A chat checkpoint ships a Jinja template that wraps messages in its special tokens (Qwen's
``<|im_start|>user ... <|im_end|>``); `render_template` renders it as transformers'
``apply_chat_template`` does, and the reply ends at the tokenizer's ``eos_token``. The shipped
Shakespeare models (and `ByteTokenizer`) get the play form of `minifer.play_chat`; a Hugging Face
checkpoint without a template (a base model) gets none: `require_chat_template` refuses it.

A template is code from the checkpoint, run on what clients send: Jinja's sandbox keeps it from
Python's internals, its operators and output are held to `MAX_TEMPLATE_CHARS`, and a server
renders in `TemplateSandbox` processes, killed at its time limit."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import select
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime

__all__ = ["chat", "chat_prompt", "render_template", "require_chat_template", "TemplateSandbox"]

MAX_TEMPLATE_CHARS = 2**22  # the most a rendered template (or a string or list it builds) holds
TEMPLATE_TIMEOUT_S = 5.0  # a server's render, from the request's arrival
TEMPLATE_MEMORY = 2**27  # bytes of address space of a render process (it needs ~25 MB)


def render_template(template: str, messages: Sequence[Mapping], *,
                    add_generation_prompt: bool = True, max_chars: int = MAX_TEMPLATE_CHARS,
                    **variables) -> str:
    """`template` (a Hugging Face chat template) rendered for `messages`, as transformers'
    ``apply_chat_template(..., tokenize=False)`` renders it. `variables`: what else the template
    reads (``bos_token``, ``eos_token``, ``tools``, ...). A template that builds (``*``, ``+``,
    ``**``) or renders more than `max_chars` characters (or items) is a `jinja2` SecurityError
    before it does; its other errors are `jinja2.TemplateError`."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # Jinja's own escapes HTML: not for prompts

    def too_big(what: str):
        return jinja2.exceptions.SecurityError(f"{what}, more than the {max_chars:,} a chat "
                                               f"template may (--chat-template-max-chars)")

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "+", "**"})

        def call_binop(self, context, operator: str, left, right):
            n = [len(x) if isinstance(x, (str, list, tuple)) else 0 for x in (left, right)]
            k = [x if type(x) is int else 0 for x in (left, right)]
            size = (n[0] + n[1] if operator == "+" else n[0] * k[1] + k[0] * n[1]
                    if operator == "*" else abs(k[0]).bit_length() * k[1])  # "**": its bits
            if size > max_chars:
                raise too_big(f"'{operator}' would build {size:,} characters or items")
            return super().call_binop(context, operator, left, right)

    env = Bounded(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    pieces, size = [], 0
    for piece in env.from_string(template).generate(
            messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
            **variables):
        size += len(piece)
        if size > max_chars:
            raise too_big(f"it renders {size:,}+ characters")
        pieces.append(piece)
    return "".join(pieces)


_WORKER = ("import importlib.util as u, sys; sys.path[:] = [p for p in sys.path if p]; "
           "s = u.spec_from_file_location('minifer_template_worker', sys.argv[1]); "
           "m = u.module_from_spec(s); s.loader.exec_module(m); m.render_worker()")
_DIED = b'{"error": "process died"}'


def render_worker() -> None:
    """A render process of `TemplateSandbox` (this file alone, not the package: it starts in a
    blink): a JSON job a line on stdin, a JSON reply a line on stdout; at low priority (the
    engine's steps come first), its memory capped at `TEMPLATE_MEMORY`."""
    import resource

    import jinja2.ext  # noqa: F401 - before the cap

    os.nice(10)
    resource.setrlimit(resource.RLIMIT_AS, (TEMPLATE_MEMORY, TEMPLATE_MEMORY))
    for line in sys.stdin:
        try:
            reply = {"text": render_template(**json.loads(line))}
        except MemoryError:
            reply = {"error": f"needs more than the {TEMPLATE_MEMORY >> 20} MiB a render may use"}
        except Exception as err:  # noqa: BLE001 - the client's 400
            reply = {"error": f"failed: {type(err).__name__}: {err}"}
        print(json.dumps(reply), flush=True)


class TemplateSandbox:
    """Renders chat templates in `workers` processes of their own, each render within
    `timeout_s` (or by a `deadline`: the request's arrival + `timeout_s`, the wait for a free
    process counted). Past it its process is killed (replaced at the next render): a template
    that loops holds no thread, core or memory of the server beyond its limit. Errors are
    ValueErrors naming the chat template and the limit it hit."""

    def __init__(self, workers: int = 2, timeout_s: float = TEMPLATE_TIMEOUT_S,
                 max_chars: int = MAX_TEMPLATE_CHARS) -> None:
        from .checks import check_int, check_number

        check_int("chat_template_workers", workers, 1)
        self.timeout_s = check_number("chat_template_timeout_s", timeout_s, gt=0, finite=True)
        self.max_chars = check_int("chat_template_max_chars", max_chars, 1)
        self._idle: queue.SimpleQueue = queue.SimpleQueue()  # processes (None: start on use)
        for _ in range(workers):
            self._idle.put(None)

    def render(self, template: str, messages: Sequence[Mapping], *,
               deadline: float | None = None, **variables) -> str:
        """`render_template` in a render process, done by `deadline` (`time.monotonic`)."""
        deadline = time.monotonic() + self.timeout_s if deadline is None else deadline
        late = ValueError(f"the chat template did not finish rendering within "
                          f"{self.timeout_s:g} s (--chat-template-timeout); it was stopped")
        try:
            proc = self._idle.get(timeout=max(deadline - time.monotonic(), 0))
        except queue.Empty:
            raise late from None  # every render process was busy until then
        job = dict(template=template, messages=[dict(m) for m in messages],
                   max_chars=self.max_chars, **variables)
        line = b""
        try:
            if proc is None or proc.poll() is not None:  # not started yet, or killed
                proc = subprocess.Popen([sys.executable, "-c", _WORKER, __file__],
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            proc.stdin.write(json.dumps(job).encode() + b"\n")
            proc.stdin.flush()
            if select.select([proc.stdout], [], [], max(deadline - time.monotonic(), 0))[0]:
                line = proc.stdout.readline() or _DIED
        except OSError:  # it died, or could not start
            line = _DIED
        finally:
            if not line:  # too late: killed (a new one starts at the next render)
                proc.kill()
                proc.wait()
            self._idle.put(proc)
        if not line:
            raise late
        reply = json.loads(line)
        if "error" in reply:
            raise ValueError(f"the chat template {reply['error']}")
        return reply["text"]

    def close(self) -> None:
        """Stop the idle render processes (one rendering now is left to finish)."""
        while not self._idle.empty():
            if (proc := self._idle.get()) is not None:
                proc.kill()
                proc.wait()


def require_chat_template(tokenizer) -> str | None:
    """The chat template of `tokenizer`, or None for the play form; a checkpoint without one (a
    base model) is a ValueError: any prompt form made up for it is one it never saw."""
    template = getattr(tokenizer, "chat_template", None)
    if template:
        return template
    folder = getattr(tokenizer, "checkpoint_folder", None)
    if folder is not None:
        raise ValueError(f"this checkpoint has no chat template ({folder} has no chat_template "
                         f"in tokenizer_config.json and no chat_template.jinja): it is not a "
                         f"chat model; use /v1/completions (minifer.generate) with a plain "
                         f"prompt instead")
    return None


def chat_prompt(messages: Sequence[Mapping], tokenizer, *,
                render: Callable[..., str] = render_template) -> tuple[str, list[str]]:
    """``(prompt text, stop strings)`` for `messages` (OpenAI-style dicts): the tokenizer's chat
    template rendered by `render` (no stop strings: the reply ends at its EOS), else the play
    form with its blank-line end of turn. Encode the prompt with ``special_tokens=True``."""
    from .play_chat import END_OF_TURN, render_chat

    template = require_chat_template(tokenizer)
    if template:
        variables = {k: v for k, v in getattr(tokenizer, "special_tokens_text", {}).items()
                     if v is not None}
        return render(template, messages, **variables), []
    prompt, _ = render_chat(messages)
    return prompt, [END_OF_TURN]


def chat(model, tokenizer, messages: Sequence[Mapping], params=None, **kwargs):
    """The model's reply to `messages`, a `minifer.Completion`: `chat_prompt`'s prompt, `params`
    (default greedy, 256 new tokens) with its stop strings added, `kwargs` to `generate`."""
    from .generation import generate
    from .sampling import SamplingParams

    prompt, stops = chat_prompt(messages, tokenizer)
    params = params or SamplingParams(temperature=0, max_new_tokens=256)
    if stops:
        params = dataclasses.replace(params, stop=(*params.stop, *stops))
    ids = tokenizer.encode(prompt, special_tokens=True)
    [completion] = generate(model, [ids], params, tokenizer, **kwargs)
    return completion

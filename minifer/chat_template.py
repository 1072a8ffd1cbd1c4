"""Chat prompts: a checkpoint's own chat template, or the play-form template of the shipped models.

A chat checkpoint ships a Jinja template that wraps messages in its special tokens (Qwen's
``<|im_start|>user ... <|im_end|>``); `render_template` renders it as transformers'
``apply_chat_template`` does, and the reply ends at the tokenizer's ``eos_token``. The shipped
Shakespeare models (and `ByteTokenizer`) get the play form of `minifer.play_chat`; a Hugging Face
checkpoint without a template (a base model) gets none: `require_chat_template` refuses it.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from datetime import datetime

__all__ = ["chat", "chat_prompt", "render_template", "require_chat_template"]


def render_template(template: str, messages: Sequence[Mapping], *,
                    add_generation_prompt: bool = True, **variables) -> str:
    """`template` (a Hugging Face chat template) rendered for `messages`, as transformers'
    ``apply_chat_template(..., tokenize=False)`` renders it. `variables`: what else the template
    reads (``bos_token``, ``eos_token``, ``tools``, ``enable_thinking``, ...)."""
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)  # Jinja's own escapes HTML: not for prompts

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(
        messages=[dict(m) for m in messages], add_generation_prompt=add_generation_prompt,
        **variables)


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


def chat_prompt(messages: Sequence[Mapping], tokenizer) -> tuple[str, list[str]]:
    """``(prompt text, stop strings)`` for `messages` (OpenAI-style dicts): the tokenizer's chat
    template (no stop strings: the reply ends at its EOS), else the play form with its
    blank-line end of turn. Encode the prompt with ``special_tokens=True``."""
    from .play_chat import END_OF_TURN, render_chat

    template = require_chat_template(tokenizer)
    if template:
        variables = {k: v for k, v in getattr(tokenizer, "special_tokens_text", {}).items()
                     if v is not None}
        return render_template(template, messages, **variables), []
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

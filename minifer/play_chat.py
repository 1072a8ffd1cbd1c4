"""The chat template of minifer's Shakespeare model: a conversation rendered as a scene of a play::

    ROMEO:
    But, soft! what light through yonder window breaks?

    JULIET:
    Ay me!

A ``user`` or ``assistant`` message is a speaker's turn (name, colon, new line, speech, blank
line), a ``system`` or ``developer`` message a stage direction. The prompt ends with the replying
speaker's name and a colon; the reply ends at the blank line (`END_OF_TURN`, a stop string) or
the end-of-text token. Speakers: a message's ``name``, else `USER` or `ASSISTANT`."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping

__all__ = ["USER", "ASSISTANT", "END_OF_TURN", "render_chat", "speech"]

USER = "ROMEO"  # who speaks a user message without a name
ASSISTANT = "JULIET"  # who speaks an assistant message (and the reply) without a name
END_OF_TURN = "\n\n"  # a blank line: the end of a speaker's turn in the plays
ROLES = ("system", "developer", "user", "assistant")


def speech(text: str) -> str:
    """A message's text as one turn: ``\\n`` line endings, no blank lines, no outer space."""
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    return re.sub(r"\n[ \t\f\v]*(?:\n[ \t\f\v]*)+", "\n", text).strip()


def render_chat(messages: Iterable[Mapping]) -> tuple[str, str]:
    """``(prompt, reply speaker)`` for OpenAI-style messages (``role``, ``content``, ``name``)."""
    parts, reply = [], ASSISTANT
    for i, m in enumerate(messages):
        role, text, name = m["role"], speech(m["content"]), m.get("name")
        if role not in ROLES:
            raise ValueError(f"messages[{i}].role must be one of {ROLES}, got {role!r}")
        if role in ("system", "developer"):
            if text:
                parts.append(f"{text}{END_OF_TURN}")
            continue
        speaker = name or (USER if role == "user" else ASSISTANT)
        if role == "assistant" and name:
            reply = name
        parts.append(f"{speaker}:\n{text}{END_OF_TURN}" if text else f"{speaker}:{END_OF_TURN}")
    return "".join(parts) + f"{reply}:\n", reply

"""A Hugging Face checkpoint without a chat template (a base model) is refused for chat with a
clear ValueError (`require_chat_template`, which the server's /v1/chat/completions can answer
with); the shipped models and `ByteTokenizer` keep their play-form template."""

from __future__ import annotations

import pytest

import minifer as mf
from minifer.chat_template import chat_prompt, require_chat_template
from minifer.pretrained import model_files

pytest.importorskip("transformers")
from test_hf_checkpoint import CHATML, MESSAGES, write_checkpoint  # noqa: E402


def test_a_checkpoint_without_a_template_refuses_chat(tmp_path):
    write_checkpoint(tmp_path, "qwen2", template=None)
    model, tok = mf.load_hf_checkpoint(tmp_path)
    message = r"this checkpoint has no chat template .* use /v1/completions"
    with pytest.raises(ValueError, match=message):
        require_chat_template(tok)
    with pytest.raises(ValueError, match=message):
        chat_prompt(MESSAGES, tok)
    with pytest.raises(ValueError, match=message):
        mf.chat(model, tok, MESSAGES)


def test_a_checkpoint_with_a_template_returns_it(tmp_path):
    write_checkpoint(tmp_path, "qwen2", template=CHATML)
    _, tok = mf.load_hf_checkpoint(tmp_path)
    assert require_chat_template(tok) == CHATML


@pytest.mark.parametrize("tokenizer", [
    lambda: mf.Tokenizer.from_file(model_files("shakespeare")[2]), mf.ByteTokenizer])
def test_the_shipped_tokenizers_keep_the_play_form(tokenizer):
    tok = tokenizer()
    assert require_chat_template(tok) is None
    prompt, stops = chat_prompt(MESSAGES, tok)
    assert prompt.endswith("JULIET:\n") and stops == ["\n\n"]

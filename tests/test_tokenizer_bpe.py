"""The shipped byte-level BPE tokenizer: exact round trips and clean streaming detokenization."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from minifer.pretrained import data_dir
from minifer.tokenizer import Tokenizer
from minifer_course.training.train import VOCAB_SIZE, train_tokenizer

TOKENIZER_JSON = data_dir() / "shakespeare" / "tokenizer.json"

SAMPLES = [
    "ROMEO:\nBut, soft! what light through yonder window breaks?\n",
    "  two leading spaces, trailing too  ",
    " a single leading space",
    "tabs\tand\r\nwindows line ends\n\n\n",
    "emoji 🤗🎭 and a family 👨‍👩‍👧 and a flag 🏳️‍🌈",
    "accents: é (composed) vs e\u0301 (combining); ñ, ß, Ω",
    "CJK 世界, Arabic مرحبا, Hindi नमस्ते, Greek ἀρχή",
    "control \x00\x01\x7f and \u200b zero width, \ufeff BOM, U+FFFD � itself",
    "math 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ∑∫√ and astral 𐍈",
    "",
]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_file(TOKENIZER_JSON)


def _stream(tok: Tokenizer, ids: list[int]) -> list[str]:
    detok = tok.detokenizer()
    return [detok.feed(i) for i in ids] + [detok.flush()]


def test_shipped_tokenizer_shape(tok):
    assert tok.vocab_size == VOCAB_SIZE == 2048
    assert tok.eos_token_id == VOCAB_SIZE - 1  # <|endoftext|> is the last id, as in GPT-2
    assert tok.token_to_text(tok.eos_token_id) == "<|endoftext|>"
    assert tok.encode("ROMEO:") != list(b"ROMEO:")  # merges were learned


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip_exact(tok, text):
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size - 1 for i in ids)  # plain text never yields EOS
    assert tok.decode(ids) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_stream_equals_decode_without_replacement_chars(tok, text):
    pieces = _stream(tok, tok.encode(text))
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_eos_in_the_stream_prints_nothing(tok):
    ids = [*tok.encode("Exeunt."), tok.eos_token_id, *tok.encode("ACT II")]
    assert "".join(_stream(tok, ids)) == "Exeunt.ACT II"
    assert tok.decode(ids) == "Exeunt.ACT II"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.text(max_size=60))
def test_round_trip_any_unicode(text):
    tok = Tokenizer.from_file(TOKENIZER_JSON)  # cheap (ms); fixtures and @given don't mix
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    pieces = _stream(tok, ids)
    assert "".join(pieces) == text
    if "\ufffd" not in text:
        assert not any("\ufffd" in p for p in pieces)


def test_train_tokenizer_small_corpus_round_trips():
    """The training recipe itself: a tiny vocabulary still encodes anything byte by byte."""
    hf = train_tokenizer(["To be, or not to be: that is the question.\n"] * 20, vocab_size=300)
    tok = Tokenizer(hf)
    assert tok.eos_token_id == tok.vocab_size - 1
    text = "Unseen: 🤗 ñ 世界 \t\n"
    assert tok.decode(tok.encode(text)) == text
    assert len(tok.encode("To be, or not to be")) < len("To be, or not to be")


def test_train_tokenizer_rejects_tiny_vocab():
    with pytest.raises(ValueError, match="vocab_size"):
        train_tokenizer(["abc"], vocab_size=100)


def test_special_token_text_in_a_prompt_stays_text():
    """A user typing "<|endoftext|>" must not inject the EOS id; the text round-trips."""
    from minifer.pretrained import load_pretrained

    _, tok = load_pretrained("shakespeare-draft")
    ids = tok.encode("a<|endoftext|>b")
    assert tok.eos_token_id not in ids and tok.decode(ids) == "a<|endoftext|>b"

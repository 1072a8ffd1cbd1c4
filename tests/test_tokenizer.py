"""ByteTokenizer round trips and the incremental detokenizer (never half a character)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from minifer import ByteTokenizer

FAST = settings(max_examples=25, deadline=None)
# any Unicode text a str can hold as valid UTF-8 (no lone surrogates), emoji and CJK included
texts = st.text(alphabet=st.characters(exclude_categories=("Cs",)), max_size=40)


def test_vocab_and_specials():
    tok = ByteTokenizer()
    assert tok.vocab_size == 257 and tok.eos_token_id == 256
    assert tok.encode("hé") == [104, 0xC3, 0xA9]
    assert tok.token_to_text(256) == "<|endoftext|>"
    assert tok.token_to_text(104) == "h" and tok.token_to_text(0xC3) == "\\xc3"
    plain = ByteTokenizer(specials=())
    assert plain.vocab_size == 256 and plain.eos_token_id is None
    with pytest.raises(TypeError):
        tok.encode([1, 2])


@FAST
@given(text=texts)
def test_round_trip_of_any_unicode(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and all(0 <= i < 256 for i in ids)
    assert tok.decode(ids) == text


def test_round_trip_examples():
    tok = ByteTokenizer()
    for text in ["", "a", "naïve café", "日本語", "👩‍👩‍👧 family", "𝄞 music", "\x00\n\t"]:
        assert tok.decode(tok.encode(text)) == text


@FAST
@given(text=texts)
def test_incremental_detokenizer_never_emits_replacement_chars(text):
    tok = ByteTokenizer()
    detok = tok.detokenizer()
    pieces = [detok.feed(i) for i in tok.encode(text)] + [detok.flush()]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == text == tok.decode(tok.encode(text))
    # every piece is whole characters: each prefix of the output is a prefix of the text
    out = ""
    for p in pieces:
        out += p
        assert text.startswith(out)


def test_four_byte_emoji_waits_for_its_last_byte():
    tok = ByteTokenizer()
    detok = tok.detokenizer()
    ids = tok.encode("😀")
    assert len(ids) == 4
    assert [detok.feed(i) for i in ids] == ["", "", "", "😀"]
    assert detok.flush() == ""


def test_special_token_ends_a_pending_character_and_prints_nothing():
    tok = ByteTokenizer()
    detok = tok.detokenizer()
    assert detok.feed(ord("a")) == "a"
    assert detok.feed(256) == ""
    assert tok.decode([ord("h"), ord("i"), 256]) == "hi"
    # a cut-off character becomes U+FFFD only when the text really ends there
    detok = tok.detokenizer()
    assert detok.feed(0xF0) == ""
    assert detok.flush() == "\ufffd"

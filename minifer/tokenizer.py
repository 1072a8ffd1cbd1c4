"""Text ⇄ token ids, and streaming detokenization that never emits half a character.

Two tokenizers share one interface (`encode`, `decode`, `vocab_size`, `eos_token_id`,
`detokenizer()`):

- `ByteTokenizer`: one token per UTF-8 byte plus an end-of-text token. No training, no files:
  used by the tests and the randomly initialised reference model.
- `Tokenizer`: a trained byte-level BPE loaded from a `tokenizer.json` written by the Hugging
  Face `tokenizers` library (the shipped Shakespeare models use one).

Why an incremental detokenizer? A byte-level token can end in the middle of a multi-byte UTF-8
character (an emoji is 4 bytes). Decoding each token on its own would print replacement
characters; a streaming server instead holds those bytes back until the character is complete.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol


class Detokenizer(Protocol):
    def feed(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class TokenizerLike(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def detokenizer(self) -> Detokenizer: ...
    def token_to_text(self, token_id: int) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then special tokens (by default only ``<|endoftext|>`` = 256)."""

    def __init__(self, specials: tuple[str, ...] = ("<|endoftext|>",)) -> None:
        self.specials = tuple(specials)
        self.vocab_size = 256 + len(self.specials)
        self.eos_token_id: int | None = 256 if "<|endoftext|>" in self.specials else None

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        detok = self.detokenizer()
        return "".join(detok.feed(i) for i in ids) + detok.flush()

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer(self)

    def token_to_text(self, token_id: int) -> str:
        """How one token looks on its own (for tables and figures): bytes shown escaped."""
        if token_id >= 256:
            return self.specials[token_id - 256]
        b = bytes([token_id])
        return b.decode("utf-8") if token_id < 128 else f"\\x{token_id:02x}"

    def __repr__(self) -> str:
        return f"ByteTokenizer(vocab_size={self.vocab_size})"


class ByteDetokenizer:
    """Feeds bytes through an incremental UTF-8 decoder: incomplete characters wait in it."""

    def __init__(self, tok: ByteTokenizer) -> None:
        self.tok = tok
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def feed(self, token_id: int) -> str:
        if token_id >= 256:  # a special token: ends any pending character, prints nothing
            return self._utf8.decode(b"", final=True)
        return self._utf8.decode(bytes([token_id]))

    def flush(self) -> str:
        return self._utf8.decode(b"", final=True)


class Tokenizer:
    """A trained byte-level BPE tokenizer (`tokenizers` library) with the `ByteTokenizer` interface."""

    def __init__(self, hf_tokenizer, eos_token: str = "<|endoftext|>") -> None:
        self.hf = hf_tokenizer
        # Text that merely looks like a special token ("<|endoftext|>" typed by a user) stays
        # text: only the engine emits the real EOS id. (tiktoken's default, too.)
        self.hf.encode_special_tokens = True
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_id: int | None = hf_tokenizer.token_to_id(eos_token)

    @classmethod
    def from_file(cls, path: str | Path, **kwargs) -> Tokenizer:
        from tokenizers import Tokenizer as HFTokenizer

        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"tokenizer file not found: {path}")
        try:
            hf = HFTokenizer.from_file(str(path))
        except Exception as err:  # the library raises a bare Exception on bad JSON
            raise ValueError(f"corrupt tokenizer file {path}: {err}") from err
        return cls(hf, **kwargs)

    def encode(self, text: str) -> list[int]:
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        return self.hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)

    def detokenizer(self) -> BPEDetokenizer:
        return BPEDetokenizer(self)

    def token_to_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


class BPEDetokenizer:
    """Streams text from BPE tokens with the library's `DecodeStream`.

    `DecodeStream.step` returns None while the bytes so far end inside a character.
    """

    def __init__(self, tok: Tokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self.tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def feed(self, token_id: int) -> str:
        return self._stream.step(self.tok.hf, token_id) or ""

    def flush(self) -> str:
        return ""  # DecodeStream never holds back a complete character

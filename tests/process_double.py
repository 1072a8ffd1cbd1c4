"""Doubles for the engine-process tests, steered through files since the engine runs in another
process: a model whose forward waits while ``gate`` exists and raises once when ``fail`` exists
(deleting it), and a tokenizer that holds the engine process's start while ``gate`` exists."""

from __future__ import annotations

import os
import time

from minifer.model import GPT
from minifer.tokenizer import ByteTokenizer


class FileSteeredGPT(GPT):
    def __init__(self, config, gate: str, fail: str) -> None:
        super().__init__(config)
        self.gate, self.fail = gate, fail

    @classmethod
    def like(cls, model: GPT, gate: str, fail: str) -> FileSteeredGPT:
        steered = cls(model.config, gate, fail)
        steered.load_state_dict(model.state_dict())
        return steered.eval()

    def forward(self, *args, **kwargs):
        deadline = time.monotonic() + 30
        while os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        if os.path.exists(self.fail):
            os.remove(self.fail)
            raise RuntimeError("injected failure")
        return super().forward(*args, **kwargs)


class GatedTokenizer(ByteTokenizer):
    """`ByteTokenizer` that, unpickled in another process (the engine process, as it starts:
    before it builds its engine and says "ready"), waits there while ``gate`` exists (30 s)."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.gate, self.made_in = gate, os.getpid()

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        deadline = time.monotonic() + 30
        while os.getpid() != self.made_in and os.path.exists(self.gate) \
                and time.monotonic() < deadline:
            time.sleep(0.01)

"""A model for the engine-process tests whose forward a test steers through files, since the
engine runs it in another process: it waits while ``gate`` exists and raises once when
``fail`` exists (deleting it)."""

from __future__ import annotations

import os
import time

from minifer.model import GPT


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

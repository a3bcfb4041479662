"""A fake engine for pipeline tests and worker benchmarks (never for testing the engine).

Deterministic: each slot's distribution is a function of the prompt, the canvas and the
slot, so a result can be recomputed and checked. `cost_per_read_s` makes it slow on
purpose (autoscaling tests need an engine with a fixed cost per read); zero makes it free
(the worker-overhead benchmark).
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence

import numpy as np

from dgstream.workers.engine.reading import slot_read_from_label_logits
from dgstream.workers.engine.types import EngineInfo, Read, ReadResult


class FakeEngine:
    def __init__(
        self, *, canvas_length: int = 64, vocab_size: int = 2048, cost_per_read_s: float = 0.0
    ) -> None:
        self.cost_per_read_s = cost_per_read_s
        self._info = EngineInfo("fake", "fake", canvas_length, vocab_size)
        self.calls = 0
        self.reads = 0

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        self.calls += 1
        self.reads += len(reads)
        if self.cost_per_read_s:
            await asyncio.sleep(self.cost_per_read_s * len(reads))
        return [self._one(r) for r in reads]

    async def close(self) -> None:
        return None

    @staticmethod
    def _one(read: Read) -> ReadResult:
        digest = hashlib.blake2b(repr((read.prompt_ids, read.canvas_ids)).encode()).digest()
        rng = np.random.default_rng(int.from_bytes(digest[:8], "little"))
        slots = tuple(
            slot_read_from_label_logits(s.question_id, rng.normal(0.0, 2.0, len(s.label_ids)))
            for s in read.slots
        )
        return ReadResult(slots)

"""The benchmarks' synthetic reads: prompts of random token ids (optionally sharing a prefix, as
one question set's system text does), a canvas of noise and three answer slots, from a seeded
generator. `bench/engine_gpu.py` and `bench/engine_vllm.py` both read these."""

from __future__ import annotations

import random

from dgstream.workers.engine.types import Read, Slot


def make_reads(
    b: int, prompt_len: int, canvas: int, shared: int, vocab: int, rng: random.Random
) -> list[Read]:
    prefix = tuple(rng.randrange(16, vocab) for _ in range(shared))
    slots = (
        Slot("toxic", 2, (100, 101), ("yes", "no")),
        Slot("category", 6, (200, 201, 202, 203), ("A", "B", "C", "D")),
        Slot("severity", 10, (300, 301, 302, 303, 304), ("1", "2", "3", "4", "5")),
    )
    reads = []
    for _ in range(b):
        prompt = prefix + tuple(rng.randrange(16, vocab) for _ in range(prompt_len - shared))
        canvas_ids = tuple(rng.randrange(0, vocab) for _ in range(canvas))
        reads.append(Read(prompt, canvas_ids, slots, shared_prefix_len=shared))
    return reads

"""The soak's reads (bench/gpu/reads_soak.py and the slow-GPU test): a fixed workload of
tagged full-size reads, and a recorder of every read's raw label logprobs.

- `workload`: batches of 1 to 256 reads, unique prompts and one of four question sets
  (shared 224-token prefixes) in turn, a fixed function of the seed; each read's tag is its
  index, so two runs can be compared read by read.
- `Recorder`: every read's label logprobs as vLLM's output held them, taken before the read
  path's own checks run (a read that fails them is kept too, with what it held).
"""

from __future__ import annotations

import math
import random
from typing import Any

from bench.harness.reads import make_reads

# A cycle of batch sizes from 1 to 256 whose reads are mostly in large batches, as a busy
# worker's are (1,151 reads a cycle; nine cycles pass 10,000).
SIZES = (256, 1, 128, 32, 256, 8, 64, 2, 16, 256, 4, 128)
QUESTION_SETS = 4
PROMPT, CANVAS, SHARED = 256, 16, 224


def workload(seed: int, reads: int, sizes: tuple[int, ...], vocab: int) -> list[list[Any]]:
    """Batches of tagged reads, `reads` of them at least, a fixed function of the seed."""
    rng = random.Random(seed)
    prefixes = [
        make_reads(1, PROMPT, CANVAS, 0, vocab, rng)[0].prompt_ids[:SHARED]
        for _ in range(QUESTION_SETS)
    ]
    batches: list[list[Any]] = []
    made = 0
    i = 0
    while made < reads:
        b = sizes[i % len(sizes)]
        fresh = make_reads(b, PROMPT, CANVAS, 0, vocab, rng)
        if i % 2:  # one question set: the shared prefix, then the read's own tokens
            pre = prefixes[(i // 2) % QUESTION_SETS]
            fresh = [
                type(r)(pre + r.prompt_ids[SHARED:], r.canvas_ids, r.slots, SHARED) for r in fresh
            ]
        batches.append(
            [
                type(r)(r.prompt_ids, r.canvas_ids, r.slots, r.shared_prefix_len, f"r{made + j}")
                for j, r in enumerate(fresh)
            ]
        )
        made += b
        i += 1
    return batches


def parse_phases(spec: str) -> list[tuple[str, int, tuple[str, ...]]]:
    """`plain:24,sync:24:sync` -> [(name, batches, flags)]; batches 0 = the rest."""
    out = []
    for part in spec.split(","):
        bits = part.split(":")
        if len(bits) < 2 or not bits[1].isdigit():
            raise ValueError(f"--phases: want NAME:BATCHES[:FLAG+FLAG], got {part!r}")
        flags = tuple(f for f in (bits[2] if len(bits) > 2 else "").split("+") if f)
        out.append((bits[0], int(bits[1]), flags))
    return out


class Recorder:
    """Every read's raw label logprobs, by tag, taken where vLLM's output is parsed."""

    def __init__(self) -> None:
        self.reads: dict[str, list[list[float | None]]] = {}

    def install(self) -> None:
        from dgstream.workers.engine.vllm import codec, engine

        original = engine.parse_output

        def parse_output(read: Any, request_output: Any, *, constrained: bool = True) -> Any:
            try:
                out = request_output.outputs[0]
                rows = []
                for slot in read.slots:
                    row = codec._position_row(out.logprobs, slot.position)
                    rows.append([_num(row.get(t)) for t in slot.label_ids])
                self.reads[read.tag] = rows
            except Exception as exc:  # the read path's own checks say what was wrong
                self.reads[read.tag] = [[None]]
                print(f"# {read.tag}: output not recorded: {exc!r}", flush=True)
            return original(read, request_output, constrained=constrained)

        engine.parse_output = parse_output


def _num(v: float | None) -> float | str | None:
    if v is None:
        return None
    if math.isnan(v):
        return "nan"
    if math.isinf(v):
        return "-inf" if v < 0 else "inf"
    return v


__all__ = ["QUESTION_SETS", "SIZES", "Recorder", "parse_phases", "workload"]

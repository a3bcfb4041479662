"""Train the demo DiffusionGemma (`SPECS["demo"]`) on the demo task family with the
single-step-read objective.

Every training example is a read built exactly as the engine builds it
(`workers.engine.template`: the tiny tokenizer's `ChatFormat`, `LayoutCache.chunks`,
`system_text`, `user_text`, `make_read` with a fresh noise seed per read): the prompt is
encoded, the canvas (answer template, end-of-turn, padding, uniform random ids at the slots)
goes through ONE decoder pass, and the loss is the cross-entropy over the FULL vocabulary at
each slot toward the true label's token id. The forward is the model's own
(`model(input_ids, attention_mask, position_ids, decoder_input_ids, decoder_attention_mask,
decoder_position_ids)`): prompts right-padded with masked pads, canvases of a narrower width
padded with masked positions, positions as in the engine (prompt from 0, canvas right after
the prompt), so the real tokens see exactly what the engine shows them (`--smoke` checks it
against `TransformersEngine`).

Determinism: requests come from `random.Random(seed)` per request seed
(`topology.demo_tasks.training_seeds`), noise from `noise_seed`, batches in a fixed order
(the worker pool's results are consumed in submission order), the weights from
`torch.manual_seed(spec.seed)`. On the CPU a run is bit-for-bit repeatable. On CUDA
`torch.use_deterministic_algorithms(True, warn_only=True)` with a fixed cuBLAS workspace
makes the matmuls and `index_add_` deterministic; the attention backward (memory-efficient
SDPA) has no deterministic kernel and only warns, so two GPU runs may differ in the last
bits. `--steps auto` picks the step count from the speed measured over steps 20-70 (before
the warmup ends, so it changes nothing before it is chosen); the log records it, and
`--steps N` replays that schedule.

Training-only questions (`--category-share`, `--name-share`, `--mention-share`; see their
functions below) can be added to a share of the training requests; they give the choice
questions' word -> category -> option chain direct signals, are logged as kinds of their own,
and never reach the held-out check.

The pointer loss (`--point-weight`, `--point-layer`) is an auxiliary term added to that
cross-entropy: at each choice (and mention) slot, -log of the attention weight that the best
head of one decoder layer puts on the true option's NAME in the prompt. It teaches the
lookup "the letter of the option whose name is the category", which the cross-entropy alone
did not find in thousands of steps (docs/benchmarks.md, rounds 9-12). The model and the
read are unchanged: the loss only shapes training.

Weights are saved in fp16 (7.3 MB; fp32 would be 14.5) and the held-out check runs on the
saved file. Needs torch, transformers, tokenizers, numpy and pydantic (the engine reads the
contract's question model; no `Classifier`: the held-out check here drives
`TransformersEngine` directly).

    python -m bench.train_demo_model --smoke                      # 20 CPU steps, < 1 min
    python -m bench.train_demo_model --device cuda --steps auto --budget-s 200 --out DIR
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.training.loop import main as _main


def main(argv: Sequence[str] | None = None) -> int:
    return _main(argv, description=__doc__.split("\n\n")[0])


if __name__ == "__main__":
    sys.exit(main())

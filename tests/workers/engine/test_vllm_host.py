"""The host-work benches' harnesses (bench/engine_host.py) on the CPU: vLLM 0.33's real
scheduler serving every read in the steps its mode takes, and its front end's processors
reading every answer; the timings themselves are the bench's, never asserted here."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest

from bench.harness.vllm_model import write_model_dir
from bench.harness.vllm_scheduler import PROMPT, WIDTH

pytestmark = pytest.mark.vllm
vllm = pytest.importorskip("vllm")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("diffusiongemma"), 1000)


@pytest.mark.parametrize(
    ("mode", "kind", "steps"),
    [
        ("one_step", "shared", 1),  # prompt and canvas of every read in one step
        ("two_step", "shared", 2),  # the prompts, then the canvases
        ("stock", "shared", 2),
        # 32 prompts of 256 tokens over steps of 4,096 (the product's budget): the prompts,
        # then the canvases of the last ones, in four steps; fused, a read's canvas runs
        # in the step that finishes its prompt, and one step fewer.
        ("two_step", "unique", 4),
        ("one_step", "unique", 3),
    ],
)
def test_the_scheduler_host_bench_serves_every_read_in_the_steps_its_mode_takes(
    model_dir: Path, mode: str, kind: str, steps: int
) -> None:
    """bench/engine_host.py's loop (tests/support/vllm_scheduler.py) from a clean
    checkout: every read of each batch served (it raises on any left), in the engine
    steps its mode takes, with each phase timed."""
    from bench.harness.vllm_scheduler import host_cost

    got = host_cost(model_dir, batch=32, kind=kind, mode=mode, rounds=2)
    assert got["steps"] == steps
    assert min(got["admit"], got["schedule"], got["update"]) > 0
    assert got["total"] == pytest.approx(got["admit"] + got["schedule"] + got["update"], rel=0.2)


def test_the_front_end_bench_reads_every_answer_through_vllms_processors(tmp_path: Path) -> None:
    """bench/engine_host.py's front end (tests/support/vllm_frontend.py) from a clean
    checkout: each read's request through vLLM's input processor, its output back through
    the messages and the output processor, and the engine's `parse_output` reading each
    slot's labels (equal logprobs: equal probabilities)."""
    from bench.harness.reads import make_reads
    from bench.harness.vllm_frontend import CORE, FRONT, VOCAB, FrontEnd

    reads = make_reads(8, PROMPT, WIDTH, 0, VOCAB, random.Random(1))
    took, results = FrontEnd(8, tmp_path).serve("t", reads)
    assert set(took) == {*FRONT, *CORE} and min(took.values()) > 0
    assert len(results) == len(reads)
    for read, result in zip(reads, results, strict=True):
        assert [s.question_id for s in result.slots] == [s.question_id for s in read.slots]
        for slot, got in zip(read.slots, result.slots, strict=True):
            assert got.probs == pytest.approx(np.full(len(slot.label_ids), 1 / len(slot.label_ids)))

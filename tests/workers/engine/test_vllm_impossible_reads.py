"""The CPU side's checks of what vLLM returns for a read: a slot whose
logprobs no correct step can give is an engine error, never an answer.

`parse_output` refuses, naming the read and the slot: a NaN (also among the labels, which
the old message called -inf), every label at -inf, a logprob above 0, column 0 (the argmax)
below another column, a constrained row that does not normalise over its ids, and an
unconstrained row whose ids hold more than all the probability. What they cannot see (a
valid row of another read) is the soak's read-by-read comparison's (bench/gpu).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("vllm")

from vllm.logprobs import FlatLogprobs, append_logprobs_for_next_position
from vllm.outputs import CompletionOutput, RequestOutput

from dgstream.workers.engine.types import Read, RecoverableEngineError, Slot
from dgstream.workers.engine.vllm.codec import NORMALIZER_TOL, check_row, parse_output

pytestmark = pytest.mark.unit

SLOT = Slot("toxic", 1, (100, 101), ("yes", "no"))
READ = Read((5, 6, 7), (9, 9, 9, 9), (SLOT,), tag="t1")
UNION = [100, 101, 200, 201]


def _output(ids: list[int], values: list[float]) -> Any:
    """vLLM's output of READ with `ids`/`values` at the slot's position (column 0 first)."""
    flat = FlatLogprobs()
    for pos in range(len(READ.canvas_ids)):
        if pos == SLOT.position:
            row_ids, row_values = ids, values
        else:  # a valid constrained row elsewhere
            lp = np.log(np.full(len(UNION), 1 / len(UNION)))
            row_ids, row_values = [UNION[0], *UNION], [float(lp[0]), *lp.tolist()]
        append_logprobs_for_next_position(
            flat, row_ids, row_values, [None] * len(row_ids), 1, len(row_ids) - 1
        )
    out = CompletionOutput(
        index=0,
        text="",
        token_ids=list(READ.canvas_ids),
        cumulative_logprob=None,
        logprobs=flat,
        finish_reason="length",
    )
    return RequestOutput("r", None, list(READ.prompt_ids), None, [out], finished=True)


def _valid(logits: list[float]) -> tuple[list[int], list[float]]:
    """A constrained row as the read path gives it: log-softmax over UNION, argmax first."""
    x = np.asarray(logits, dtype=np.float64)
    lp = x - np.logaddexp.reduce(x)
    best = int(np.argmax(lp))
    return [UNION[best], *UNION], [float(lp[best]), *lp.tolist()]


def test_a_valid_constrained_row_reads() -> None:
    ids, values = _valid([2.0, 1.0, -1.0, 0.5])
    result = parse_output(READ, _output(ids, values), constrained=True)
    (slot,) = result.slots
    assert slot.probs == pytest.approx([1 / (1 + math.e**-1), 1 / (1 + math.e)])


NAN = float("nan")
INF = float("inf")
# (name, the slot position's ids and values, constrained, what the error says)
IMPOSSIBLE: list[tuple[str, list[int], list[float], bool, str]] = [
    ("a label is NaN", [100, 100, 101, 200, 201], [-0.5, -0.5, NAN, -2.0, -3.0], True, "NaN"),
    ("every value NaN", [100, 100, 101, 200, 201], [NAN] * 5, True, "NaN"),
    ("every label -inf", [200, 100, 101, 200, 201], [0.0, -INF, -INF, 0.0, -INF], True, "-inf"),
    ("NaN outside the labels", [100, 100, 101, 200, 201], [-1, -1, -1, NAN, -2], True, "NaN"),
    ("a logprob above 0", [100, 100, 101, 200, 201], [0.5, 0.5, -1, -2, -3], True, "above 0"),
    ("+inf", [100, 100, 101, 200, 201], [INF, INF, -1, -2, -3], True, "above 0"),
    ("argmax not the max", [101, 100, 101, 200, 201], [-3.0, -0.1, -3.0, -4, -5], True, "argmax"),
    ("does not normalise", [100, 100, 101, 200, 201], [-1.0, -1.0, -1.2, -1.3, -1.4], True, "sum"),
    ("two rows' halves", [100, 100, 101, 200, 201], [-0.1, -0.1, -3, -9, -9], True, "sum"),
    ("more than everything", [100, 100, 101], [-0.1, -0.1, -0.2], False, "sum"),
]


@pytest.mark.parametrize(
    ("ids", "values", "constrained", "says"),
    [pytest.param(*row[1:], id=row[0]) for row in IMPOSSIBLE],
)
def test_an_impossible_row_is_an_engine_error_naming_the_read_and_slot(
    ids: list[int], values: list[float], constrained: bool, says: str
) -> None:
    with pytest.raises(RecoverableEngineError, match=says) as err:
        parse_output(READ, _output(ids, values), constrained=constrained)
    if "-inf" not in says and "NaN" not in str(err.value).split(":")[-1]:
        assert "'t1'" in str(err.value) and "'toxic'" in str(err.value)


def test_an_unconstrained_row_may_hold_less_than_everything() -> None:
    # The labels and the argmax hold 0.6 of the full vocabulary's probability.
    ids = [7, 100, 101]
    values = [math.log(0.4), math.log(0.15), math.log(0.05)]
    (slot,) = parse_output(READ, _output(ids, values), constrained=False).slots
    assert slot.probs == pytest.approx([0.75, 0.25])
    assert slot.label_mass == pytest.approx(0.2)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.floats(min_value=-40, max_value=40, allow_nan=False), min_size=len(UNION), max_size=4
    )
)
def test_every_log_softmax_row_passes_the_checks(logits: list[float]) -> None:
    """No false alarm: any row the read path can give (float32 rounding included) reads."""
    ids, values = _valid(logits)
    rounded = np.asarray(values, dtype=np.float32).astype(np.float64).tolist()
    check_row("here", ids, rounded, constrained=True)
    check_row("here", ids, [min(0.0, v + 0.5 * NORMALIZER_TOL) for v in rounded], True)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.floats(min_value=-20, max_value=5, allow_nan=False), min_size=4, max_size=4),
    st.floats(min_value=0.01, max_value=5.0),
)
def test_a_row_shifted_off_its_normaliser_is_refused(logits: list[float], shift: float) -> None:
    ids, values = _valid(logits)
    shifted = [v - shift for v in values]
    with pytest.raises(RecoverableEngineError, match="sum to"):
        check_row("here", ids, shifted, constrained=True)

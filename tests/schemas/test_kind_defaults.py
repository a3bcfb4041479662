"""The defaults question kinds inherit from `Kind` (schemas/kinds/_base.py), held by what
they must do for every kind that does not override them: a route field the kind does not
name has no value; a written answer's distribution is the engine's when asked for it and
written; a temper that loses or adds a probability fails instead of dropping an answer."""

from __future__ import annotations

from typing import Any

import pytest

from dgstream.schemas.kinds import get_kind
from dgstream.schemas.kinds.choice import ChoiceAnswer
from dgstream.schemas.kinds.score import ScoreAnswer

pytestmark = pytest.mark.unit

CHOICE = ChoiceAnswer(
    choice="english", probabilities={"english": 0.7, "french": 0.3}, confidence=0.7
)
SCORE = ScoreAnswer(
    expected_score=1.4,
    level="none",
    legend={"1": "none", "2": "one", "3": "many"},
    probabilities={"none": 0.7, "one": 0.2, "many": 0.1},
    confidence=0.7,
)


@pytest.mark.parametrize(("name", "answer"), [("choice", CHOICE), ("score", SCORE)])
def test_a_field_the_kind_does_not_name_has_no_value(name: str, answer: Any) -> None:
    kind = get_kind(name)
    for field in ("confidence", "probabilities", "type"):
        assert field not in kind.fields
        assert kind.value(answer, field) is None
    for field in kind.fields:
        assert kind.value(answer, field) is not None


def test_the_distribution_is_the_engines_when_asked_and_written() -> None:
    kind = get_kind("choice")
    written = {
        "type": "choice",
        "choice": "english",
        "probabilities": {"english": 0.6, "french": 0.4},
        "raw_probabilities": {"english": 0.9, "french": 0.1},
    }
    assert kind.distribution(written, raw=True) == (("english", "french"), (0.9, 0.1))
    assert kind.distribution(written, raw=False) == (("english", "french"), (0.6, 0.4))
    # Not calibrated: the engine's are the probabilities themselves.
    plain = {k: v for k, v in written.items() if k != "raw_probabilities"}
    assert kind.distribution(plain, raw=True) == (("english", "french"), (0.6, 0.4))
    assert kind.distribution({"type": "choice"}, raw=False) is None


@pytest.mark.parametrize(("name", "answer"), [("choice", CHOICE), ("score", SCORE)])
def test_a_temper_that_loses_a_probability_fails(name: str, answer: Any) -> None:
    kind = get_kind(name)
    labels = list(answer.probabilities)
    assert kind.calibrated(answer, labels, lambda ps: list(ps)) is not None
    with pytest.raises(ValueError):
        kind.calibrated(answer, labels, lambda ps: list(ps)[:-1])
    with pytest.raises(ValueError):
        kind.calibrated(answer, labels, lambda ps: [*ps, 0.0])


# ------------------------------------------------------------------ score's own


def test_score_in_jevs_shape_is_clamped_to_the_scale_and_rounded_to_six_places() -> None:
    kind = get_kind("score")
    fine = SCORE.model_copy(update={"expected_score": 1.123456789})
    assert kind.to_jev(fine).score == 0.123457
    # An expected score past the scale (a float's rounding, say) stays on the scale's 0..n-1.
    past = SCORE.model_construct(**{**SCORE.model_dump(), "expected_score": 3.75})
    assert kind.to_jev(past).score == 2.0


def test_jevs_score_names_an_index_the_legend_lacks_by_the_index() -> None:
    written = {
        "type": "score",
        "score": 0.5,
        "probabilities": {"0": 0.5, "1": 0.3, "2": 0.2},
        "legend": {"0": "none", "1": "mild"},
    }
    got = get_kind("score").distribution(written, raw=False)
    assert got == (("none", "mild", "2"), (0.5, 0.3, 0.2))


def test_a_calibrated_score_has_its_expected_score_rounded_to_six_places() -> None:
    kind = get_kind("score")
    out = kind.calibrated(SCORE, list(SCORE.probabilities), lambda ps: [1 / 3, 1 / 3, 1 / 3])
    assert out is not None
    assert out.expected_score == 2.0  # 1/3 + 2/3 + 3/3, rounded
    out = kind.calibrated(SCORE, list(SCORE.probabilities), lambda ps: [0.1234567, 0.8765433, 0.0])
    assert out is not None and out.expected_score == round(0.1234567 + 2 * 0.8765433, 6)
    assert out.expected_score == 1.876543

"""Temperature calibration: the fit finds the temperature that undoes a known distortion, the
map keeps every label and the engine's probabilities, and a file that does not match a
question leaves it alone."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dgstream.schemas import ClassificationResult, Diagnostics
from dgstream.schemas.result import ChoiceAnswer, ScoreAnswer, SkippedAnswer, YesNoAnswer
from dgstream.workers.results.calibration import (
    T_MAX,
    T_MIN,
    Calibration,
    Calibrator,
    Distribution,
    Example,
    QuestionCalibration,
    distribution,
    ece,
    fit,
    fit_temperature,
    load_calibration,
    nll,
    tempered,
)

pytestmark = pytest.mark.unit


def synthetic(n: int, classes: int, distort: float, seed: int = 0) -> list[Example]:
    """Answers of a calibrated model (labels drawn from its own probabilities), then
    distorted by temperature `distort`: what a miscalibrated engine would say."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        logits = rng.normal(0.0, 2.0, classes)
        p = np.exp(logits - logits.max())
        p /= p.sum()
        truth = int(rng.choice(classes, p=p))
        out.append(Example(tuple(tempered(p, distort)), truth))
    return out


@pytest.mark.parametrize(("classes", "distort"), [(2, 0.4), (2, 2.5), (5, 0.5), (4, 1.0)])
def test_the_fit_undoes_a_known_temperature(classes: int, distort: float) -> None:
    examples = synthetic(4000, classes, distort)
    t = fit_temperature(examples)
    assert t == pytest.approx(1.0 / distort, rel=0.1)
    assert nll(examples, t) <= nll(examples) + 1e-9
    if distort != 1.0:
        assert ece(examples, t) < ece(examples) / 2


def test_the_fit_is_the_nll_minimum() -> None:
    examples = synthetic(800, 3, 0.6, seed=3)
    t = fit_temperature(examples)
    for other in (t * 0.9, t * 1.1):
        assert nll(examples, t) <= nll(examples, other)


def test_degenerate_examples_stop_at_the_bounds() -> None:
    right = [Example((0.9, 0.1), 0), Example((0.2, 0.8), 1)] * 10
    assert fit_temperature(right) == T_MIN
    wrong = [Example((0.9, 0.1), 1), Example((0.2, 0.8), 0)] * 10
    # Always wrong: the flattest map is best, and for two answers that means T_MAX.
    assert fit_temperature(wrong) == T_MAX
    with pytest.raises(ValueError):
        fit_temperature([])


@settings(max_examples=200, deadline=None)
@given(
    probs=st.lists(st.floats(0.0, 1.0), min_size=2, max_size=8).filter(lambda v: sum(v) > 0.01),
    t=st.floats(T_MIN, T_MAX),
)
def test_a_temperature_keeps_the_order_and_the_sum(probs: list[float], t: float) -> None:
    p = [v / sum(probs) for v in probs]
    q = tempered(p, t)
    assert math.isclose(sum(q), 1.0, rel_tol=1e-9)
    assert all(0.0 <= v <= 1.0 for v in q)
    for i in range(len(p)):
        for j in range(len(p)):
            if p[i] > p[j] + 1e-9 and max(p[i], p[j]) > 1e-9:
                assert q[i] >= q[j]
    if min(min(p) ** (1.0 / t), min(p)) > 1e-7:  # away from the floor, 1/T undoes T
        assert tempered(tempered(p, t), 1.0 / t) == pytest.approx(p, abs=1e-6)


# --------------------------------------------------------------------------- applying


def _result(**answers: object) -> ClassificationResult:
    return ClassificationResult(
        id="r",
        status="ok",
        answers=answers,
        diagnostics=Diagnostics(
            reads=1, entropy={}, label_mass={}, model="demo", engine="t", worker="w"
        ),
    )


def _q(kind: str, labels: list[str], t: float) -> QuestionCalibration:
    return QuestionCalibration(
        kind=kind,  # type: ignore[arg-type]
        labels=labels,
        temperature=t,
        examples=50,
        nll_before=1.0,
        nll_after=0.5,
        ece_before=0.2,
        ece_after=0.01,
    )


CAL = Calibration(
    questions={
        "insult": _q("yes_no", ["yes", "no"], 2.0),
        "language": _q("choice", ["english", "french"], 0.5),
        "excitement": _q("score", ["none", "one", "many"], 2.0),
    }
)


def test_apply_tempers_keeps_labels_and_the_engines_probabilities() -> None:
    res = _result(
        insult=YesNoAnswer(p_yes=0.9, label="yes", confidence=0.9),
        language=ChoiceAnswer(
            choice="english", probabilities={"english": 0.7, "french": 0.3}, confidence=0.7
        ),
        excitement=ScoreAnswer(
            expected_score=1.4,
            level="none",
            legend={"1": "none", "2": "one", "3": "many"},
            probabilities={"none": 0.7, "one": 0.2, "many": 0.1},
            confidence=0.7,
        ),
        other=YesNoAnswer(p_yes=0.8, label="yes", confidence=0.8),
        skipped=SkippedAnswer(reason="x"),
    )
    out = Calibrator(CAL).apply(res)
    a = out.answers
    insult, language, excitement = a["insult"], a["language"], a["excitement"]
    assert isinstance(insult, YesNoAnswer) and insult.raw_p_yes == 0.9
    want = 0.9**0.5 / (0.9**0.5 + 0.1**0.5)
    assert insult.p_yes == pytest.approx(want, abs=1e-6) and insult.label == "yes"
    assert insult.confidence == insult.p_yes
    assert isinstance(language, ChoiceAnswer) and language.choice == "english"
    assert language.probabilities["english"] == pytest.approx(0.49 / 0.58, abs=1e-6)
    assert language.raw_probabilities == {"english": 0.7, "french": 0.3}
    assert language.confidence == language.probabilities["english"]
    assert isinstance(excitement, ScoreAnswer) and excitement.level == "none"
    assert excitement.raw_probabilities == {"none": 0.7, "one": 0.2, "many": 0.1}
    p = excitement.probabilities
    assert excitement.expected_score == pytest.approx(
        p["none"] + 2 * p["one"] + 3 * p["many"], abs=2e-6
    )
    assert a["other"] == res.answers["other"] and a["skipped"] == res.answers["skipped"]
    assert res.answers["insult"].raw_p_yes is None  # type: ignore[union-attr]  # untouched


def test_a_question_that_does_not_match_the_file_stays_raw() -> None:
    res = _result(
        language=ChoiceAnswer(
            choice="german", probabilities={"german": 0.6, "french": 0.4}, confidence=0.6
        ),
        insult=ChoiceAnswer(choice="a", probabilities={"a": 0.6, "b": 0.4}, confidence=0.6),
    )
    assert Calibrator(CAL).apply(res) is res


def test_the_file_round_trips_and_its_hash_is_its_content(tmp_path: Path) -> None:
    path = tmp_path / "cal.json"
    path.write_text(CAL.model_dump_json(indent=2))
    again = load_calibration(path)
    assert again == CAL and again.hash == CAL.hash and again.hash.startswith("sha256:")
    other = CAL.model_copy(
        update={"questions": {**CAL.questions, "insult": _q("yes_no", ["yes", "no"], 2.1)}}
    )
    assert other.hash != CAL.hash
    path.write_text(json.dumps({"questions": {"q": {"kind": "yes_no"}}}))
    with pytest.raises(ValueError, match="not a calibration file"):
        load_calibration(path)
    with pytest.raises(ValueError, match="cannot read"):
        load_calibration(tmp_path / "missing.json")


# --------------------------------------------------------------------------- from results


def test_distributions_are_read_from_both_result_shapes_raw_first() -> None:
    ours = {"type": "yes_no", "p_yes": 0.8, "raw_p_yes": 0.6, "label": "yes", "confidence": 0.8}
    raw = distribution(ours)
    assert (
        raw is not None and raw.labels == ("yes", "no") and raw.probs == pytest.approx((0.6, 0.4))
    )
    calibrated = distribution(ours, raw=False)
    assert calibrated is not None and calibrated.probs == pytest.approx((0.8, 0.2))
    assert distribution({"type": "noul", "noul": 0.25}).probs == (0.25, 0.75)  # type: ignore[union-attr]
    jev_score = {
        "type": "score",
        "score": 0.4,
        "confidence": 0.6,
        "probabilities": {"0": 0.6, "1": 0.4},
        "legend": {"0": "none", "1": "one"},
    }
    got = distribution(jev_score)
    assert got is not None and got.labels == ("none", "one") and got.answer == "none"
    assert distribution({"type": "skipped", "reason": "x"}) is None


def test_fit_from_labelled_results_says_what_it_left_out() -> None:
    rng = random.Random(0)
    pairs = []
    for _ in range(200):
        p = rng.random()
        truth = "yes" if rng.random() < p else "no"
        overconfident = tempered([p, 1 - p], 0.3)[0]
        pairs.append(
            (Distribution("yes_no", ("yes", "no"), (overconfident, 1 - overconfident)), truth)
        )
    few = pairs[:5]
    sure = [(Distribution("yes_no", ("yes", "no"), (0.9, 0.1)), "yes")] * 30
    odd = [(Distribution("yes_no", ("yes", "no"), (0.5, 0.5)), "maybe")] * 30
    labelled = {"insult": pairs, "rare": few, "odd": odd, "sure": sure}
    cal, skipped = fit(labelled, min_examples=20, source="t")
    assert set(cal.questions) == {"insult", "sure"}
    q = cal.questions["insult"]
    assert q.temperature == pytest.approx(1 / 0.3, rel=0.35)
    assert q.ece_after < q.ece_before and q.nll_after < q.nll_before
    assert "5 labelled examples" in skipped["rare"] and "maybe" in skipped["odd"]
    # Every answer right: sharper, but only to about (n + 0.5) / (n + 1), not to T_MIN.
    sure_q = cal.questions["sure"]
    assert T_MIN < sure_q.temperature < 1.0
    assert tempered([0.9, 0.1], sure_q.temperature)[0] == pytest.approx(30.5 / 31, abs=0.002)

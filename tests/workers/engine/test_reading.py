"""From slot logits to answers, on numbers worked out by hand: a slot's distribution, its
entropy and label mass; several reads combined (mean, standard error of the chosen label,
agreement); and the three answer shapes, rounded to 6 decimals."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from dgstream.schemas.kinds import get_kind
from dgstream.workers.engine.reading import (
    Aggregate,
    aggregate,
    entropy,
    slot_read_from_label_logits,
)
from dgstream.workers.engine.types import SlotRead

pytestmark = pytest.mark.unit


def _slot(probs: list[float], mass: float | None = None) -> SlotRead:
    p = np.asarray(probs, dtype=np.float64)
    return SlotRead("q", p, entropy(p), mass, None)


# --------------------------------------------------------------------------- one slot


def test_entropy_in_nats_ignores_impossible_labels() -> None:
    assert entropy(np.array([1.0, 0.0])) == 0.0
    assert entropy(np.array([0.5, 0.5])) == pytest.approx(math.log(2))
    assert entropy(np.array([0.25, 0.25, 0.5, 0.0])) == pytest.approx(1.5 * math.log(2))


def test_slot_read_is_the_softmax_over_the_labels() -> None:
    logits = np.array([1.0, 3.0, 0.0])
    read = slot_read_from_label_logits("topic", logits)
    want = np.exp(logits) / np.exp(logits).sum()
    assert read.question_id == "topic"
    np.testing.assert_allclose(read.probs, want, rtol=0, atol=1e-15)
    assert read.entropy == pytest.approx(float(-(want * np.log(want)).sum()), abs=1e-12)
    assert (read.label_mass, read.argmax_is_label) == (None, None)  # not known


def test_slot_read_is_stable_for_huge_logits() -> None:
    read = slot_read_from_label_logits("q", np.array([1000.0, 1000.0 + math.log(3)]))
    np.testing.assert_allclose(read.probs, [0.25, 0.75], rtol=0, atol=1e-12)


def test_label_mass_and_argmax_from_the_full_vocabulary() -> None:
    logits = np.array([2.0, 1.0])
    # The full vocabulary: the two labels and two other tokens at 0 and 3.
    full = np.array([2.0, 1.0, 0.0, 3.0])
    lse = float(np.log(np.exp(full).sum()))
    read = slot_read_from_label_logits("q", logits, logsumexp_all=lse, max_logit_all=3.0)
    assert read.label_mass == pytest.approx((math.e**2 + math.e) / np.exp(full).sum(), abs=1e-12)
    assert read.argmax_is_label is False  # token 3 beats both labels
    tie = slot_read_from_label_logits("q", logits, logsumexp_all=lse, max_logit_all=2.0)
    assert tie.argmax_is_label is True  # a label at the full maximum counts
    # Rounding may put the labels' log-sum-exp a hair above the full one: capped at 1.
    capped = slot_read_from_label_logits("q", logits, logsumexp_all=2.0, max_logit_all=2.0)
    assert capped.label_mass == 1.0


# --------------------------------------------------------------------------- several reads


def test_one_read_is_its_own_aggregate() -> None:
    agg = aggregate([_slot([0.2, 0.5, 0.3], mass=0.9)])
    np.testing.assert_allclose(agg.mean, [0.2, 0.5, 0.3])
    assert (agg.argmax, agg.confidence, agg.reads) == (1, 0.5, 1)
    assert (agg.stderr, agg.agreement) == (None, None)
    assert agg.label_mass == 0.9
    assert agg.entropy == pytest.approx(entropy(np.array([0.2, 0.5, 0.3])))


def test_two_reads_have_a_standard_error() -> None:
    agg = aggregate([_slot([0.1, 0.9]), _slot([0.3, 0.7])])
    # Column 1 is chosen: its sample standard deviation is 0.1414..., over sqrt(2).
    assert agg.argmax == 1
    assert agg.stderr == round(float(np.std([0.9, 0.7], ddof=1)) / math.sqrt(2), 6) == 0.1
    assert agg.agreement == 1.0
    assert agg.reads == 2


def test_stderr_and_agreement_of_the_chosen_label_rounded_to_6_decimals() -> None:
    reads = [[0.2, 0.5, 0.3], [0.1, 0.7, 0.2], [0.3, 0.6, 0.1], [0.45, 0.4, 0.15]]
    agg = aggregate([_slot(p, mass=m) for p, m in zip(reads, [0.9, 0.8, None, 0.7], strict=True)])
    column = np.array(reads)[:, 1]
    exact = float(np.std(column, ddof=1) / 2)
    assert agg.stderr == round(exact, 6) and agg.stderr != exact  # 0.0645497...
    assert agg.agreement == 0.75
    assert agg.label_mass == pytest.approx(0.8)  # the mean of the reads that know it
    assert agg.entropy == pytest.approx(np.mean([entropy(np.array(p)) for p in reads]))
    np.testing.assert_allclose(agg.mean, np.mean(reads, axis=0), rtol=0, atol=1e-15)
    assert agg.confidence == pytest.approx(0.55)
    # One in three: rounded, not a long fraction.
    thirds = aggregate([_slot([0.6, 0.4]), _slot([0.7, 0.3]), _slot([0.4, 0.6])])
    assert thirds.agreement == 0.666667


def test_no_label_mass_when_no_read_knows_it() -> None:
    assert aggregate([_slot([0.5, 0.5]), _slot([0.4, 0.6])]).label_mass is None


# --------------------------------------------------------------------------- answers


def _agg(mean: list[float], stderr: float | None = None, agreement: float | None = None) -> Any:
    m = np.asarray(mean)
    return Aggregate(m, float(m.max()), int(m.argmax()), stderr, agreement, 0.5, None, 2)


# Each kind builds its answer (`Kind.build`, schemas/kinds/).
def yes_no_answer(agg: Aggregate) -> Any:
    return get_kind("yes_no").build(agg, ("yes", "no"))


def choice_answer(agg: Aggregate, options: list[str]) -> Any:
    return get_kind("choice").build(agg, options)


def score_answer(agg: Aggregate, levels: list[str]) -> Any:
    return get_kind("score").build(agg, levels)


def test_yes_no_answer() -> None:
    yes = yes_no_answer(_agg([0.123456789, 0.876543211], stderr=0.01, agreement=0.5))
    assert (yes.type, yes.label, yes.p_yes, yes.confidence) == ("yes_no", "no", 0.123457, 0.876543)
    assert (yes.stderr, yes.agreement) == (0.01, 0.5)
    assert yes_no_answer(_agg([0.6, 0.4])).label == "yes"


def test_choice_answer() -> None:
    ans = choice_answer(_agg([0.1, 0.6543219, 0.2456781], 0.02, 1.0), ["a", "b", "c"])
    assert (ans.type, ans.choice, ans.confidence) == ("choice", "b", 0.654322)
    assert ans.probabilities == {"a": 0.1, "b": 0.654322, "c": 0.245678}
    assert (ans.stderr, ans.agreement) == (0.02, 1.0)


def test_score_answer() -> None:
    ans = score_answer(_agg([0.1, 0.2, 0.7], 0.03, 0.75), ["low", "mid", "high"])
    assert (ans.type, ans.level) == ("score", "high")
    assert ans.expected_score == 2.6  # 1 * 0.1 + 2 * 0.2 + 3 * 0.7
    assert ans.legend == {"1": "low", "2": "mid", "3": "high"}
    assert ans.probabilities == {"low": 0.1, "mid": 0.2, "high": 0.7}
    assert (ans.confidence, ans.stderr, ans.agreement) == (0.7, 0.03, 0.75)
    odd = score_answer(_agg([1 / 3, 1 / 3 - 1e-7, 1 / 3 + 1e-7]), ["a", "b", "c"])
    assert odd.expected_score == round(1 / 3 + 2 * (1 / 3 - 1e-7) + 3 * (1 / 3 + 1e-7), 6)
    assert odd.expected_score == 2.0


def test_a_distribution_that_does_not_match_the_labels_is_an_error() -> None:
    # One probability per option or level, or no answer: a shorter distribution would
    # silently leave labels out of `probabilities`.
    with pytest.raises(ValueError, match="zip"):
        choice_answer(_agg([0.4, 0.6]), ["a", "b", "c"])
    with pytest.raises(ValueError, match="zip"):
        score_answer(_agg([0.4, 0.6]), ["low", "mid", "high"])

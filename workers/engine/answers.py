"""Aggregated reads into the answer shapes of `schemas` (step 6 of the single-step read)."""

from __future__ import annotations

from collections.abc import Sequence

from schemas import ChoiceAnswer, ScoreAnswer, YesNoAnswer
from workers.engine.reading import Aggregate


def _clean(p: float) -> float:
    # Keep results readable and stable in JSON: probabilities to 6 decimals.
    return round(float(p), 6)


def yes_no_answer(agg: Aggregate) -> YesNoAnswer:
    p_yes = _clean(agg.mean[0])
    return YesNoAnswer(
        type="yes_no",
        p_yes=p_yes,
        label="yes" if agg.argmax == 0 else "no",
        confidence=_clean(agg.confidence),
        stderr=agg.stderr,
        agreement=agg.agreement,
    )


def choice_answer(agg: Aggregate, options: Sequence[str]) -> ChoiceAnswer:
    return ChoiceAnswer(
        type="choice",
        choice=options[agg.argmax],
        probabilities={name: _clean(p) for name, p in zip(options, agg.mean, strict=True)},
        confidence=_clean(agg.confidence),
        stderr=agg.stderr,
        agreement=agg.agreement,
    )


def score_answer(agg: Aggregate, levels: Sequence[str]) -> ScoreAnswer:
    expected = float(sum((i + 1) * p for i, p in enumerate(agg.mean)))
    return ScoreAnswer(
        type="score",
        expected_score=round(expected, 6),
        level=levels[agg.argmax],
        legend={str(i + 1): level for i, level in enumerate(levels)},
        probabilities={level: _clean(p) for level, p in zip(levels, agg.mean, strict=True)},
        confidence=_clean(agg.confidence),
        stderr=agg.stderr,
        agreement=agg.agreement,
    )

"""`type: score`: place the state on an ordered scale of 2..10 levels, lowest first. The
model writes 1..9 then letters, one per level; the answer is the most probable `level` and
the `expected_score` (1..n); Jev's shape counts levels from 0 (`score`, keyed "0".."n-1")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from dgstream.schemas._common import WireModel
from dgstream.schemas.content import NULL_LEVEL_NAME, Content
from dgstream.schemas.errors import ErrorCode
from dgstream.schemas.kinds import register
from dgstream.schemas.kinds._base import (
    Aggregated,
    Answered,
    Kind,
    Probability,
    QuestionBase,
    RouteField,
    clean,
    heading,
)
from dgstream.schemas.kinds._labels import LABEL_RULES, check_names
from dgstream.schemas.kinds.choice import LETTERS

MIN_LEVELS, MAX_LEVELS = 2, 10
# Slack for sums of float probabilities (an expected score a hair past the top level, or
# outside 0..n-1 in Jev's count).
_EPS = 1e-6


def level_names(levels: Sequence[str | None]) -> tuple[str, ...]:
    """The names of a score's levels: a null level is named by its 0-based position."""
    return tuple(
        NULL_LEVEL_NAME.format(i) if level is None else level for i, level in enumerate(levels)
    )


class ScoreQuestion(QuestionBase):
    """Place the state on an ordered scale of 2..10 levels, lowest first."""

    type: Literal["score"]
    criteria: list[Content | None] = Field(
        min_length=MIN_LEVELS,
        max_length=MAX_LEVELS,
        description="Level names (text, JSON read as its text, or null), lowest first; "
        'numbered 1..n in results. A null level is named "level <i>" with i its 0-based '
        "position (its Jev score). Names are not blank, " + LABEL_RULES,
    )

    @field_validator("criteria")
    @classmethod
    def _check_levels(cls, value: list[str | None]) -> list[str | None]:
        check_names(
            level_names(value),
            noun="level",
            invalid=ErrorCode.INVALID_LEVEL_NAME,
            duplicate=ErrorCode.DUPLICATE_LEVEL,
            repeat_note=" (a null level is named by its 0-based position)" if None in value else "",
        )
        return value

    @property
    def kind(self) -> str:
        return "score"

    @property
    def answers(self) -> tuple[str, ...]:
        return level_names(self.criteria)


class ScoreAnswer(Answered):
    type: Literal["score"] = "score"
    expected_score: float = Field(
        description="Sum of level number times probability; levels are numbered 1..n."
    )
    level: str = Field(description="The most probable level's name.")
    legend: dict[str, str] = Field(description='Level number ("1".."n") -> level name.')
    probabilities: dict[str, Probability] = Field(description="Level name -> probability.")
    raw_probabilities: dict[str, Probability] | None = Field(
        default=None,
        description="The engine's probabilities before the pipeline's calibration; null when "
        "no calibration applied to this question.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> ScoreAnswer:
        n = len(self.legend)
        if list(self.legend) != [str(i) for i in range(1, n + 1)]:
            raise ValueError('legend keys must be "1".."n" in order')
        if set(self.legend.values()) != set(self.probabilities):
            raise ValueError("probabilities must be keyed by the legend's level names")
        if self.level not in self.probabilities:
            raise ValueError(f"level {self.level!r} is not in the legend")
        if not 1 - _EPS <= self.expected_score <= n + _EPS:
            raise ValueError(f"expected_score must lie in 1..{n}")
        return self


class JevScoreAnswer(WireModel):
    type: Literal["score"] = "score"
    score: float = Field(
        description="Expected level: sum of 0-based level index times its probability."
    )
    confidence: Probability = Field(description="The most probable level's probability.")
    probabilities: dict[str, Probability] = Field(
        description='Level index ("0".."n-1") -> probability.'
    )
    legend: dict[str, str] = Field(description='Level index ("0".."n-1") -> level name.')

    @model_validator(mode="after")
    def _consistent(self) -> JevScoreAnswer:
        keys = [str(i) for i in range(len(self.legend))]
        if list(self.legend) != keys or list(self.probabilities) != keys:
            raise ValueError('legend and probabilities must be keyed "0".."n-1" in order')
        if not -_EPS <= self.score <= len(keys) - 1 + _EPS:
            raise ValueError(f"score must lie in 0..{len(keys) - 1}")
        return self


def _order(answer: ScoreAnswer) -> list[str]:
    """The level names, lowest first."""
    return [answer.legend[str(i + 1)] for i in range(len(answer.legend))]


@register
class Score(Kind):
    name = "score"
    types = ("score",)
    question = ScoreQuestion
    answer = ScoreAnswer
    jev = JevScoreAnswer
    criteria_codes: ClassVar[Mapping[str, ErrorCode]] = {
        "too_long": ErrorCode.TOO_MANY_LEVELS,
        "too_short": ErrorCode.TOO_FEW_LEVELS,
    }
    fields: ClassVar[Mapping[str, RouteField]] = {
        # A score of n levels: 0..n-1 (Jev's score), 1..n (ours); n is at most 10.
        "score": RouteField("number", 0.0, 9.0),
        "expected_score": RouteField("number", 1.0, 10.0),
        "level": RouteField("text"),
    }
    # 1..9: the tenth level's "A" is among the choice's letters.
    shared_labels = tuple(str(i) for i in range(1, 10))
    headline = "expected_score"
    answer_field = "level"

    def labels(self, question: Any) -> tuple[str, ...]:
        # 1..9 then letters: "9" is the last one-character digit.
        n = len(question.answers)
        return tuple(str(i + 1) if i < 9 else LETTERS[i - 9] for i in range(n))

    def prompt(self, qid: str, question: Any, labels: Sequence[str]) -> list[str]:
        lines = [heading(qid, f"score, {labels[0]} = lowest", question.instructions)]
        for label, level, given in zip(labels, question.answers, question.criteria, strict=True):
            # A null level has no words to show: its label alone marks the step.
            lines.append(f"  {label}" if given is None else f"  {label}: {level}")
        return lines

    def answer_fields(self, agg: Aggregated, answers: Sequence[str]) -> dict[str, Any]:
        expected = float(sum((i + 1) * p for i, p in enumerate(agg.mean)))
        return {
            "expected_score": round(expected, 6),
            "level": answers[agg.argmax],
            "legend": {str(i + 1): level for i, level in enumerate(answers)},
            "probabilities": {level: clean(p) for level, p in zip(answers, agg.mean, strict=True)},
        }

    def line(self, answer: Mapping[str, Any]) -> str:
        if "score" in answer:  # Jev's: the levels by 0-based index
            top = max(answer["probabilities"], key=answer["probabilities"].get)
            return f"{answer['legend'][top]} score={answer['score']:.2f}"
        return f"{answer['level']} E={answer['expected_score']:.2f}"

    def value(self, answer: Any, field: str) -> Any:
        # Jev's score counts levels from 0; the others are the answer's own.
        return answer.expected_score - 1.0 if field == "score" else super().value(answer, field)

    def field_range(self, field: str, answers: int) -> tuple[float, float] | None:
        if field == "score":
            return 0.0, answers - 1.0
        if field == "expected_score":
            return 1.0, float(answers)
        return None

    def to_jev(self, answer: Any) -> JevScoreAnswer:
        names = _order(answer)
        n = len(names)
        expected = min(max(answer.expected_score - 1.0, 0.0), n - 1.0)
        return JevScoreAnswer(
            score=round(expected, 6),
            confidence=answer.confidence,
            probabilities={str(i): answer.probabilities[name] for i, name in enumerate(names)},
            legend={str(i): name for i, name in enumerate(names)},
        )

    def named(self, answer: Mapping[str, Any], probs: Mapping[Any, Any]) -> Mapping[Any, Any]:
        if "score" not in answer:
            return probs
        # Jev's: keyed "0".."n-1", names in the legend
        legend = answer.get("legend") or {}
        return {str(legend.get(k, k)): v for k, v in probs.items()}

    def tempered(self, answer: Any, probs: Mapping[str, float]) -> dict[str, Any]:
        order = _order(answer)
        expected = sum((i + 1) * probs[name] for i, name in enumerate(order))
        return {"expected_score": round(min(max(expected, 1.0), float(len(order))), 6)}

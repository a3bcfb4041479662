"""`type: noul` (Jev's name) or `yes_no`: a yes/no question. The model writes `yes` or `no`;
the answer is `p_yes` and its `label`; Jev's shape is `{"type": "noul", "noul": p_yes}`."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, model_validator

from dgstream.schemas._common import RequestModel, WireModel, fail
from dgstream.schemas.content import Content
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

_ANSWERS = ("yes", "no")


class YesNoCriteria(RequestModel):
    """What `yes` and what `no` mean (either may be left out or null; text or JSON)."""

    true: Content | None = None
    false: Content | None = None


class YesNoQuestion(QuestionBase):
    """A yes/no question. `type` "noul" (the Jev API's name) and "yes_no" mean the same."""

    type: Literal["noul", "yes_no"]
    criteria: YesNoCriteria | None = None

    @model_validator(mode="after")
    def _something_to_ask(self) -> YesNoQuestion:
        crit = self.criteria
        if self.instructions is None and not (crit and (crit.true or crit.false)):
            raise fail(
                ErrorCode.EMPTY_INSTRUCTIONS,
                "a yes/no question needs instructions or a described outcome "
                "(criteria.true or criteria.false)",
                suffix="instructions",
            )
        return self

    @property
    def kind(self) -> str:
        return "yes_no"

    @property
    def answers(self) -> tuple[str, ...]:
        return _ANSWERS


class YesNoAnswer(Answered):
    type: Literal["yes_no"] = "yes_no"
    p_yes: Probability
    label: Literal["yes", "no"]
    raw_p_yes: Probability | None = Field(
        default=None,
        description="The engine's p_yes before the pipeline's calibration; null when no "
        "calibration applied to this question (p_yes is then the engine's).",
    )


class JevNoulAnswer(WireModel):
    type: Literal["noul"] = "noul"
    noul: Probability = Field(description="Probability of yes.")


@register
class YesNo(Kind):
    name = "yes_no"
    types = ("noul", "yes_no")
    question = YesNoQuestion
    answer = YesNoAnswer
    jev = JevNoulAnswer
    fields: ClassVar[Mapping[str, RouteField]] = {"p_yes": RouteField("number", 0.0, 1.0)}
    shared_labels = _ANSWERS
    headline = "p_yes"
    compared = ("yes",)  # p(no) moves as much, the other way
    answer_field = "label"

    def labels(self, question: Any) -> tuple[str, ...]:
        # The model writes the answers themselves.
        return _ANSWERS

    def prompt(self, qid: str, question: Any, labels: Sequence[str]) -> list[str]:
        lines = [heading(qid, "yes/no", question.instructions)]
        crit = question.criteria
        if crit is not None and crit.true:
            lines.append(f"  yes: {crit.true}")
        if crit is not None and crit.false:
            lines.append(f"  no: {crit.false}")
        return lines

    def answer_fields(self, agg: Aggregated, answers: Sequence[str]) -> dict[str, Any]:
        return {"p_yes": clean(agg.mean[0]), "label": "yes" if agg.argmax == 0 else "no"}

    def line(self, answer: Mapping[str, Any]) -> str:
        if answer.get("type") == "noul":  # Jev's
            return f"p_yes={answer['noul']:.2f}"
        return f"{answer['label']} p_yes={answer['p_yes']:.2f}"

    def to_jev(self, answer: Any) -> JevNoulAnswer:
        return JevNoulAnswer(noul=answer.p_yes)

    def distribution(
        self, answer: Mapping[str, Any], raw: bool
    ) -> tuple[tuple[str, ...], tuple[float, ...]] | None:
        p = answer.get("raw_p_yes") if raw else None
        if p is None:
            p = answer.get("p_yes", answer.get("noul"))
        if not isinstance(p, int | float):
            return None
        return _ANSWERS, (float(p), 1.0 - float(p))

    def calibrated(
        self,
        answer: Any,
        labels: Sequence[str],
        temper: Callable[[Sequence[float]], list[float]],
    ) -> YesNoAnswer:
        # Its answers are fixed: a calibration file's names need no check.
        p = temper([answer.p_yes, 1.0 - answer.p_yes])[0]
        updated: YesNoAnswer = answer.model_copy(
            update={
                "p_yes": p,
                "confidence": max(p, clean(1.0 - p)),
                "raw_p_yes": answer.p_yes,
            }
        )
        return updated

"""`type: choice`: pick one of 2..26 named options. The model writes a letter, A..Z, one per
option; the answer is the `choice` and every option's probability, as in Jev's shape."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from dgstream.schemas._common import WireModel, fail
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
from dgstream.schemas.kinds._labels import LABEL_RULES, check_names

MAX_OPTION_CHARS = 64
# One read carries one single-token label per option, A..Z (vLLM 0.33's decision reader caps
# choices at 26 the same way); Jev itself takes up to 255 options.
MIN_OPTIONS, MAX_OPTIONS = 2, 26
JEV_MAX_OPTIONS = 255
LETTERS = tuple(chr(c) for c in range(ord("A"), ord("Z") + 1))


class ChoiceQuestion(QuestionBase):
    """Pick one of 2..26 named options (Jev takes 255; one read carries 26 labels)."""

    type: Literal["choice"]
    criteria: dict[str, Content | None] = Field(
        min_length=MIN_OPTIONS,
        max_length=MAX_OPTIONS,
        description="Option name -> description (text, JSON read as its text, or null), in "
        "order. 2..26 options: one read carries one single-token label per option (A..Z). "
        "Names are not blank, at most 64 characters, " + LABEL_RULES,
    )

    @field_validator("criteria", mode="before")
    @classmethod
    def _count_options(cls, value: Any) -> Any:
        if isinstance(value, dict) and len(value) > MAX_OPTIONS:
            within = "within" if len(value) <= JEV_MAX_OPTIONS else "beyond"
            raise fail(
                ErrorCode.TOO_MANY_OPTIONS,
                f"{len(value)} options; dgstream answers at most {MAX_OPTIONS}: one read "
                f"carries one single-token label per option (A..Z) ({within} Jev's "
                f"{JEV_MAX_OPTIONS}). Split the options over several questions",
            )
        return value

    @field_validator("criteria")
    @classmethod
    def _check_options(cls, value: dict[str, str | None]) -> dict[str, str | None]:
        check_names(
            value,
            noun="option",
            invalid=ErrorCode.INVALID_OPTION_NAME,
            duplicate=ErrorCode.DUPLICATE_OPTION,
            max_chars=MAX_OPTION_CHARS,
        )
        return value

    @property
    def kind(self) -> str:
        return "choice"

    @property
    def answers(self) -> tuple[str, ...]:
        return tuple(self.criteria)


class ChoiceAnswer(Answered):
    type: Literal["choice"] = "choice"
    choice: str = Field(description="The option name chosen.")
    probabilities: dict[str, Probability] = Field(description="Option name -> probability.")
    raw_probabilities: dict[str, Probability] | None = Field(
        default=None,
        description="The engine's probabilities before the pipeline's calibration; null when "
        "no calibration applied to this question.",
    )

    @model_validator(mode="after")
    def _choice_is_an_option(self) -> ChoiceAnswer:
        if self.choice not in self.probabilities:
            raise ValueError(f"choice {self.choice!r} is not among the probabilities' options")
        return self


class JevChoiceAnswer(WireModel):
    type: Literal["choice"] = "choice"
    choice: str = Field(description="The most probable option's name.")
    confidence: Probability = Field(description="Its probability.")
    probabilities: dict[str, Probability] = Field(description="Option name -> probability.")


@register
class Choice(Kind):
    name = "choice"
    types = ("choice",)
    question = ChoiceQuestion
    answer = ChoiceAnswer
    jev = JevChoiceAnswer
    criteria_codes: ClassVar[Mapping[str, ErrorCode]] = {
        "too_long": ErrorCode.TOO_MANY_OPTIONS,
        "too_short": ErrorCode.TOO_FEW_OPTIONS,
    }
    fields: ClassVar[Mapping[str, RouteField]] = {"choice": RouteField("text")}
    shared_labels = LETTERS
    answer_field = "choice"

    def labels(self, question: Any) -> tuple[str, ...]:
        return LETTERS[: len(question.answers)]

    def prompt(self, qid: str, question: Any, labels: Sequence[str]) -> list[str]:
        lines = [heading(qid, "choice", question.instructions)]
        for label, name in zip(labels, question.answers, strict=True):
            desc = question.criteria[name]
            lines.append(f"  {label}: {name}" + (f" - {desc}" if desc else ""))
        return lines

    def answer_fields(self, agg: Aggregated, answers: Sequence[str]) -> dict[str, Any]:
        return {
            "choice": answers[agg.argmax],
            "probabilities": {name: clean(p) for name, p in zip(answers, agg.mean, strict=True)},
        }

    def line(self, answer: Mapping[str, Any]) -> str:
        return f"{answer['choice']} ({answer['confidence']:.2f})"  # ours and Jev's alike

    def to_jev(self, answer: Any) -> JevChoiceAnswer:
        return JevChoiceAnswer(
            choice=answer.choice,
            confidence=answer.confidence,
            probabilities=dict(answer.probabilities),
        )

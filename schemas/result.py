"""Classification results: one answer per question, told apart by `type`, plus diagnostics."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from schemas._common import WireModel
from schemas._version import SchemaVersion
from schemas.audit import Audit

Probability = Annotated[float, Field(ge=0.0, le=1.0)]

# Slack for sums of float probabilities (an expected score a hair past the top level).
_EPS = 1e-6


class _Answered(WireModel):
    confidence: Probability = Field(description="Probability of the answer given (the max).")
    stderr: float | None = Field(
        default=None,
        ge=0.0,
        description="Standard error, across reads, of the probability behind `confidence`; "
        "null with one read.",
    )
    agreement: Probability | None = Field(
        default=None,
        description="Share of reads whose own argmax is the final answer; null with one read.",
    )


class YesNoAnswer(_Answered):
    type: Literal["yes_no"] = "yes_no"
    p_yes: Probability
    label: Literal["yes", "no"]
    raw_p_yes: Probability | None = Field(
        default=None,
        description="The engine's p_yes before the pipeline's calibration; null when no "
        "calibration applied to this question (p_yes is then the engine's).",
    )


class ChoiceAnswer(_Answered):
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


class ScoreAnswer(_Answered):
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


class SkippedAnswer(WireModel):
    """A question that was not asked: its `ask_if` was not met."""

    type: Literal["skipped"] = "skipped"
    reason: str


Answer = Annotated[
    YesNoAnswer | ChoiceAnswer | ScoreAnswer | SkippedAnswer, Field(discriminator="type")
]


class Diagnostics(WireModel):
    reads: int = Field(ge=0, description="Single-step reads taken for this request.")
    entropy: dict[str, float] = Field(
        description="Question id -> entropy (nats) of its mean answer distribution."
    )
    label_mass: dict[str, float | None] = Field(
        description="Question id -> probability the full vocabulary gave the labels together "
        "(low: the model wanted to write something else); null when the engine cannot know."
    )
    model: str
    engine: str
    worker: str
    timings: dict[str, float] = Field(
        default_factory=dict, description="Milliseconds, e.g. queue, engine, total."
    )
    input_tokens: int = Field(
        default=0, ge=0, description="Prompt tokens, summed over this request's reads."
    )
    output_tokens: int = Field(
        default=0,
        ge=0,
        description="Canvas positions the model computed (template, end-of-turn and padding), "
        "summed over this request's reads.",
    )


class ClassificationResult(WireModel):
    """The answer to one request, published on the output (or the request's reply) topic."""

    schema_version: SchemaVersion = 1
    id: str = Field(description="The request's id.")
    id_source: Literal["request", "event", "key", "record"] = Field(
        default="request",
        description='Where the id came from: "request" (its body), "event" (the id of the '
        'structured-mode CloudEvent that carried a body without one), "key" (the record\'s '
        'key: the body had no id), "record" (<topic>-<partition>-<offset>: no id and no '
        "usable key).",
    )
    requested_model: str | None = Field(
        default=None, description="The request's `model` (Jev's clients send one), or null."
    )
    status: Literal["ok", "partial"] = Field(
        description='"partial": some questions have no answer in `answers`.'
    )
    answers: dict[str, Answer]
    diagnostics: Diagnostics
    metadata: dict[str, Any] = Field(
        default_factory=dict, description="Echoed from the request, untouched."
    )
    audit: Audit | None = Field(
        default=None,
        description="What decided this result (model, checkpoint, prompt, questions, engine "
        "settings, route, calibration, worker). A pipeline always writes it; null only "
        "from the engine alone (`dgstream ask`).",
    )

"""Classification results: one answer per question, told apart by `type`, plus diagnostics."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field

from dgstream.schemas._common import WireModel
from dgstream.schemas._version import SchemaVersion
from dgstream.schemas.audit import Audit
from dgstream.schemas.kinds import Answered, KindUnion, Probability, holds_kinds

# Each kind's answer model is its module's (`schemas/kinds/`); the three kinds' are here too,
# where the contract's readers have found them.
from dgstream.schemas.kinds.choice import ChoiceAnswer
from dgstream.schemas.kinds.score import ScoreAnswer
from dgstream.schemas.kinds.yes_no import YesNoAnswer

__all__ = [
    "Answer",
    "ChoiceAnswer",
    "ClassificationResult",
    "Diagnostics",
    "Probability",
    "ScoreAnswer",
    "SkippedAnswer",
    "YesNoAnswer",
]


class SkippedAnswer(WireModel):
    """A question that was not asked: its `ask_if` was not met."""

    type: Literal["skipped"] = "skipped"
    reason: str


# An answer of any registered kind, told apart by `type`, or a skipped question.
if TYPE_CHECKING:
    Answer = Answered | SkippedAnswer
else:

    class Answer(KindUnion):
        part = "answer"
        extra = (SkippedAnswer,)


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
        default=0,
        ge=0,
        description="Prompt tokens, summed over this request's reads: the text's, and those "
        "the engine lays for each image it reads (66 an image on the transformers and vLLM "
        "engines).",
    )
    output_tokens: int = Field(
        default=0,
        ge=0,
        description="Canvas positions the model computed (template, end-of-turn and padding), "
        "summed over this request's reads.",
    )


@holds_kinds
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

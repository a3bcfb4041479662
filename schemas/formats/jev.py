"""Results in the Jev API's response shape (`output_format: jev`), for pipelines whose
consumers are Jev clients.

`{"model", "answers", "usage": {"input_tokens", "output_tokens"}}`, with answers:
- yes/no: `{"type": "noul", "noul": p_yes}`;
- choice: `{"type": "choice", "choice", "confidence", "probabilities": {option: p}}`;
- score: `{"type": "score", "score", "confidence", "probabilities", "legend"}`, where `score`
  is the probability-weighted 0-based level index and both maps are keyed "0".."n-1".

A question not asked (its `ask_if` unmet: a dgstream extension) has no answer here, as Jev's
own client shows an answer type it does not know; Jev's response models, applied to a
record's value directly, would refuse one.

`to_jev` converts a `ClassificationResult`; nothing is computed again.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from schemas._common import WireModel
from schemas.formats import register
from schemas.formats._base import Format, NoOptions
from schemas.result import (
    ChoiceAnswer,
    ClassificationResult,
    ScoreAnswer,
    SkippedAnswer,
    YesNoAnswer,
)

Probability = Annotated[float, Field(ge=0.0, le=1.0)]
# Slack for an expected score a hair outside 0..n-1 (sums of rounded probabilities).
_EPS = 1e-6


class JevNoulAnswer(WireModel):
    type: Literal["noul"] = "noul"
    noul: Probability = Field(description="Probability of yes.")


class JevChoiceAnswer(WireModel):
    type: Literal["choice"] = "choice"
    choice: str = Field(description="The most probable option's name.")
    confidence: Probability = Field(description="Its probability.")
    probabilities: dict[str, Probability] = Field(description="Option name -> probability.")


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


JevAnswer = Annotated[JevNoulAnswer | JevChoiceAnswer | JevScoreAnswer, Field(discriminator="type")]


class JevUsage(WireModel):
    input_tokens: int = Field(ge=0, description="Prompt tokens, summed over the reads.")
    output_tokens: int = Field(ge=0, description="Canvas positions computed, summed.")


class JevResponse(WireModel):
    """A result as Jev's `POST /v1/systemone` answers."""

    model: str = Field(description="The model that answered (the pipeline's engine model).")
    answers: dict[str, JevAnswer]
    usage: JevUsage


def _score(answer: ScoreAnswer) -> JevScoreAnswer:
    n = len(answer.legend)
    names = [answer.legend[str(i + 1)] for i in range(n)]
    expected = min(max(answer.expected_score - 1.0, 0.0), n - 1.0)
    return JevScoreAnswer(
        score=round(expected, 6),
        confidence=answer.confidence,
        probabilities={str(i): answer.probabilities[name] for i, name in enumerate(names)},
        legend={str(i): name for i, name in enumerate(names)},
    )


def jev_answer(
    answer: YesNoAnswer | ChoiceAnswer | ScoreAnswer | SkippedAnswer,
) -> JevNoulAnswer | JevChoiceAnswer | JevScoreAnswer | None:
    """One answer in Jev's shape (None for a skipped one, which Jev has no shape for)."""
    if isinstance(answer, YesNoAnswer):
        return JevNoulAnswer(noul=answer.p_yes)
    if isinstance(answer, ChoiceAnswer):
        return JevChoiceAnswer(
            choice=answer.choice,
            confidence=answer.confidence,
            probabilities=dict(answer.probabilities),
        )
    if isinstance(answer, ScoreAnswer):
        return _score(answer)
    return None


def to_jev(result: ClassificationResult) -> JevResponse:
    """`result` in Jev's response shape (its id, status and metadata have no place there:
    the record's key and headers carry the correlation; skipped answers are left out)."""
    diag = result.diagnostics
    answers = {qid: jev_answer(a) for qid, a in result.answers.items()}
    return JevResponse(
        model=diag.model,
        answers={qid: a for qid, a in answers.items() if a is not None},
        usage=JevUsage(input_tokens=diag.input_tokens, output_tokens=diag.output_tokens),
    )


@register
class Jev(Format[NoOptions]):
    name = "jev"
    options = NoOptions
    response = JevResponse
    schema_file = "jev_result.schema.json"

    def encode(self, result: ClassificationResult, options: NoOptions) -> bytes:
        return to_jev(result).model_dump_json().encode()

    def recognises(self, obj: Mapping[str, Any]) -> bool:
        # Answers and usage but no id; an object with results and no answers is OpenAI's
        # moderation shape, whatever else it holds.
        moderation = "results" in obj and "answers" not in obj
        return "id" not in obj and "usage" in obj and not moderation

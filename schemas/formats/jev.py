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
from typing import TYPE_CHECKING, Any

from pydantic import Field

from dgstream.schemas._common import WireModel
from dgstream.schemas.formats import register
from dgstream.schemas.formats._base import Format, NoOptions
from dgstream.schemas.kinds import KindUnion, holds_kinds, kind_of_type

# Each kind's answer in Jev's shape is its module's (`schemas/kinds/`); the three kinds' are
# here too, where Jev's readers have found them.
from dgstream.schemas.kinds.choice import JevChoiceAnswer
from dgstream.schemas.kinds.score import JevScoreAnswer
from dgstream.schemas.kinds.yes_no import JevNoulAnswer
from dgstream.schemas.result import ClassificationResult

__all__ = [
    "JevAnswer",
    "JevChoiceAnswer",
    "JevNoulAnswer",
    "JevResponse",
    "JevScoreAnswer",
    "JevUsage",
    "jev_answer",
    "to_jev",
]

if TYPE_CHECKING:
    JevAnswer = WireModel
else:

    class JevAnswer(KindUnion):
        part = "jev"


class JevUsage(WireModel):
    input_tokens: int = Field(ge=0, description="Prompt tokens, summed over the reads.")
    output_tokens: int = Field(ge=0, description="Canvas positions computed, summed.")


@holds_kinds
class JevResponse(WireModel):
    """A result as Jev's `POST /v1/systemone` answers."""

    model: str = Field(description="The model that answered (the pipeline's engine model).")
    answers: dict[str, JevAnswer]
    usage: JevUsage


def jev_answer(answer: Any) -> WireModel | None:
    """One answer in Jev's shape (None for a skipped one, which Jev has no shape for)."""
    kind = kind_of_type(answer.type)
    return None if kind is None else kind.to_jev(answer)


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

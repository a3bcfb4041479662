"""The wire contract: requests, results and dead letters, as pydantic v2 models.

The worker reads requests only through `parse_request`, which returns the request or a
`RequestError` (an `ErrorCode`, a message, the field's path) and never raises for bad input.
`python -m schemas.export` writes the JSON Schema files in `schemas/json/`.
"""

from schemas._version import SCHEMA_VERSION
from schemas.dead_letter import DeadLetter, OriginalHeader, SourceRef
from schemas.errors import ErrorCode, RequestError, RequestRejected
from schemas.parse import DEFAULT_LIMITS, ParseLimits, parse_request, request_id_hint
from schemas.request import (
    ChoiceQuestion,
    ClassificationRequest,
    Question,
    QuestionKind,
    ScoreQuestion,
    YesNoCriteria,
    YesNoQuestion,
    question_order,
)
from schemas.result import (
    Answer,
    ChoiceAnswer,
    ClassificationResult,
    Diagnostics,
    ScoreAnswer,
    SkippedAnswer,
    YesNoAnswer,
)

__all__ = [
    "DEFAULT_LIMITS",
    "SCHEMA_VERSION",
    "Answer",
    "ChoiceAnswer",
    "ChoiceQuestion",
    "ClassificationRequest",
    "ClassificationResult",
    "DeadLetter",
    "Diagnostics",
    "ErrorCode",
    "OriginalHeader",
    "ParseLimits",
    "Question",
    "QuestionKind",
    "RequestError",
    "RequestRejected",
    "ScoreAnswer",
    "ScoreQuestion",
    "SkippedAnswer",
    "SourceRef",
    "YesNoAnswer",
    "YesNoCriteria",
    "YesNoQuestion",
    "parse_request",
    "question_order",
    "request_id_hint",
]

"""The wire contract: requests, results and dead letters, as pydantic v2 models.

The worker reads requests only through `parse_request`, which returns the request or a
`RequestError` (an `ErrorCode`, a message, the field's path) and never raises for bad input.
Results go out through `encode_output` in the pipeline's format (`formats`, one module
each: ours, Jev's response shape, OpenAI's moderation shape); questions and answers are
of the kinds in `kinds` (one module each: yes/no, choice, score); `audit` says what decided
each; `cloudevents` reads structured-mode events and writes the attributes of our own
records.
`python -m dgstream.schemas.export` writes the JSON Schema files in `schemas/json/`.
"""

from dgstream.schemas._version import SCHEMA_VERSION
from dgstream.schemas.audit import Audit, AuditImage, digest
from dgstream.schemas.cloudevents import EventRef
from dgstream.schemas.dead_letter import DeadLetter, OriginalHeader, SourceRef
from dgstream.schemas.errors import ErrorCode, RequestError, RequestRejected
from dgstream.schemas.formats import format_names, get_format
from dgstream.schemas.formats.jev import JevResponse, to_jev
from dgstream.schemas.formats.openai_moderation import (
    ModerationOptions,
    ModerationResponse,
    to_moderation,
)
from dgstream.schemas.output import OutputFormat, encode_output, read_output
from dgstream.schemas.parse import (
    DEFAULT_LIMITS,
    FallbackId,
    ParseLimits,
    parse_request,
    record_id,
    request_id_hint,
)
from dgstream.schemas.request import (
    ChoiceQuestion,
    ClassificationRequest,
    IdSource,
    Question,
    QuestionKind,
    ScoreQuestion,
    YesNoCriteria,
    YesNoQuestion,
    question_order,
)
from dgstream.schemas.result import (
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
    "Audit",
    "AuditImage",
    "ChoiceAnswer",
    "ChoiceQuestion",
    "ClassificationRequest",
    "ClassificationResult",
    "DeadLetter",
    "Diagnostics",
    "ErrorCode",
    "EventRef",
    "FallbackId",
    "IdSource",
    "JevResponse",
    "ModerationOptions",
    "ModerationResponse",
    "OriginalHeader",
    "OutputFormat",
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
    "digest",
    "encode_output",
    "format_names",
    "get_format",
    "parse_request",
    "question_order",
    "read_output",
    "record_id",
    "request_id_hint",
    "to_jev",
    "to_moderation",
]

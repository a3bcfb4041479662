"""Classification requests: a text (`state`) and the questions to answer about it.

Questions have the Jev API's shape and are told apart by `type`; a body as Jev's clients send
it (`POST /v1/systemone`: no `id`, a `model`, state and texts as JSON, null criteria) is a
request. They may depend on one another (`depends_on`: asked after those questions, with their
answers in the prompt) or be asked only when another question's answer is among given values
(`ask_if`, which implies the dependency).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Annotated, Any, Literal, NamedTuple

from pydantic import (
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationInfo,
    field_validator,
    model_validator,
)

from dgstream.schemas import kinds
from dgstream.schemas._common import LIMITS_CTX, RequestModel, fail, json_type
from dgstream.schemas._version import SchemaVersion
from dgstream.schemas.cloudevents import EventRef
from dgstream.schemas.content import Content, json_depth
from dgstream.schemas.errors import ErrorCode, RequestRejected
from dgstream.schemas.images import (
    MAX_IMAGES,
    ImagePart,
    ImageRef,
    InputPart,
    JevAsset,
    check_reference,
)
from dgstream.schemas.kinds import KindUnion, QuestionBase, holds_kinds
from dgstream.schemas.kinds._base import MAX_INSTRUCTIONS_CHARS, Instructions

# The three kinds' models and limits, where the contract's readers have found them.
from dgstream.schemas.kinds.choice import (
    JEV_MAX_OPTIONS,
    MAX_OPTION_CHARS,
    MAX_OPTIONS,
    MIN_OPTIONS,
    ChoiceQuestion,
)
from dgstream.schemas.kinds.score import MAX_LEVELS, MIN_LEVELS, ScoreQuestion, level_names
from dgstream.schemas.kinds.yes_no import YesNoCriteria, YesNoQuestion
from dgstream.schemas.names import QUESTION_ID_PATTERN, TOPIC_PATTERN, is_question_id

__all__ = [
    "JEV_MAX_OPTIONS",
    "MAX_ID_CHARS",
    "MAX_INSTRUCTIONS_CHARS",
    "MAX_LEVELS",
    "MAX_OPTIONS",
    "MAX_OPTION_CHARS",
    "MAX_QUESTIONS",
    "MIN_LEVELS",
    "MIN_OPTIONS",
    "ChoiceQuestion",
    "ClassificationRequest",
    "IdSource",
    "Question",
    "QuestionBase",
    "QuestionKind",
    "ScoreQuestion",
    "YesNoCriteria",
    "YesNoQuestion",
    "level_names",
    "question_order",
    "question_types",
]

# The normalized kind of a question: a registered kind's name (`schemas.kinds`).
QuestionKind = str
# Where a request's id came from: its body, the structured CloudEvent that carried it, the
# record's key, or the record's topic-partition-offset (see `schemas.parse.record_id`).
IdSource = Literal["request", "event", "key", "record"]

MAX_QUESTIONS = 64
MAX_ID_CHARS = 128
MIN_SAMPLES, MAX_SAMPLES = 1, 16
MIN_AUTO_MAX = 2
# Metadata is echoed inside the result; deeper nesting cannot be serialized back reliably.
MAX_METADATA_DEPTH = 64
MAX_MODEL_CHARS = 128

_ID_PATTERN = r"^[^\x00-\x1F\x7F-\x9F]+$"

# --- questions ----------------------------------------------------------------------------------

# Each kind's question model is its module's (`schemas/kinds/`); a request holds any
# registered one, told apart by `type`.
if TYPE_CHECKING:
    Question = QuestionBase
else:

    class Question(KindUnion):
        part = "question"


def question_types() -> tuple[str, ...]:
    """Every question `type` the wire takes ("noul", "yes_no", "choice", "score", ...)."""
    return kinds.question_types()


# --- the dependency graph -----------------------------------------------------------------------


class _Problem(NamedTuple):
    code: ErrorCode
    text: str
    field: str


def _graph_problem(questions: Mapping[str, QuestionBase]) -> _Problem | None:
    """The first problem with the references between questions, in a fixed order."""
    for qid, question in questions.items():
        for ref in question.depends_on:
            where = f"questions.{qid}.depends_on"
            if ref == qid:
                return _Problem(ErrorCode.DEPENDENCY_CYCLE, f"{qid!r} depends on itself", where)
            if ref not in questions:
                return _Problem(
                    ErrorCode.UNKNOWN_DEPENDENCY, f"depends on unknown question {ref!r}", where
                )
        for ref, values in (question.ask_if or {}).items():
            where = f"questions.{qid}.ask_if"
            if ref == qid:
                return _Problem(ErrorCode.DEPENDENCY_CYCLE, f"{qid!r} is asked if itself", where)
            if ref not in questions:
                return _Problem(
                    ErrorCode.UNKNOWN_DEPENDENCY, f"ask_if names unknown question {ref!r}", where
                )
            allowed = questions[ref].answers
            where = f"{where}.{ref}"
            if not values:
                return _Problem(ErrorCode.INVALID_ASK_IF_VALUE, "lists no answers", where)
            for value in values:
                if value not in allowed:
                    return _Problem(
                        ErrorCode.INVALID_ASK_IF_VALUE,
                        f"{value!r} is not an answer of {ref!r}; its answers are "
                        + ", ".join(repr(a) for a in allowed),
                        where,
                    )
    cycle = _find_cycle(questions)
    if cycle is not None:
        first, second = cycle[0], cycle[1]
        edge = "depends_on" if second in questions[first].depends_on else "ask_if"
        return _Problem(
            ErrorCode.DEPENDENCY_CYCLE,
            "dependency cycle " + " -> ".join(cycle),
            f"questions.{first}.{edge}",
        )
    return None


def _find_cycle(questions: Mapping[str, QuestionBase]) -> list[str] | None:
    """A cycle as [a, b, ..., a] (the first found visiting in request order), or None."""
    done: set[str] = set()
    for root in questions:
        if root in done:
            continue
        path: list[str] = [root]
        on_path = {root}
        stack = [iter(questions[root].prerequisites)]
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                stack.pop()
                finished = path.pop()
                on_path.discard(finished)
                done.add(finished)
                continue
            if nxt in on_path:
                return [*path[path.index(nxt) :], nxt]
            if nxt in done:
                continue
            path.append(nxt)
            on_path.add(nxt)
            stack.append(iter(questions[nxt].prerequisites))
    return None


def question_order(questions: Mapping[str, QuestionBase]) -> list[list[str]]:
    """Stages for the engine: each question comes one stage after the last it waits for.

    Stage 0 holds the questions that wait for none; within a stage, request order is kept.
    Raises `RequestRejected` (UNKNOWN_DEPENDENCY, DEPENDENCY_CYCLE, INVALID_ASK_IF_VALUE) when the
    references are broken (never for a request that `parse_request` accepted).
    """
    problem = _graph_problem(questions)
    if problem is not None:
        raise RequestRejected(problem.code, f"{problem.field}: {problem.text}", problem.field)
    depth: dict[str, int] = {}

    def stage_of(qid: str) -> int:
        if qid not in depth:
            waits = questions[qid].prerequisites
            depth[qid] = 1 + max((stage_of(p) for p in waits), default=-1)
        return depth[qid]

    stages: list[list[str]] = []
    for qid in questions:
        level = stage_of(qid)
        while len(stages) <= level:
            stages.append([])
        stages[level].append(qid)
    return stages


# --- the request ----------------------------------------------------------------------------------


def _limits(info: ValidationInfo) -> Any:
    return info.context.get(LIMITS_CTX) if isinstance(info.context, dict) else None


def _input_text(value: Any) -> Any:
    """The state an OpenAI moderation `input` stands for: the string, or its text parts
    joined by newlines ("" for images alone). A malformed `input` gives "" here and is
    reported by its own field's check."""
    if isinstance(value, str):
        return value
    if not isinstance(value, list):
        return ""
    texts = [
        p["text"]
        for p in value
        if isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
    ]
    return "\n".join(texts)


def _state_or_input(schema: dict[str, Any]) -> None:
    """Published schema: `state`, or OpenAI moderation's `input` in its place."""
    schema["required"] = [f for f in schema.get("required", []) if f != "state"]
    schema["oneOf"] = [{"required": ["state"]}, {"required": ["input"]}]


@holds_kinds
class ClassificationRequest(RequestModel):
    """One request: answer `questions` (or the configured `question_set`) about `state`."""

    model_config = ConfigDict(json_schema_extra=_state_or_input)

    schema_version: SchemaVersion = 1
    id: str = Field(
        min_length=1,
        max_length=MAX_ID_CHARS,
        pattern=_ID_PATTERN,
        description="Correlates the result with the request; no control characters. May be "
        "left out (as Jev's clients do): the worker then takes the record's key, else "
        "<topic>-<partition>-<offset>, and the result's id_source says which.",
    )
    model: str | None = Field(
        default=None,
        min_length=1,
        max_length=MAX_MODEL_CHARS,
        pattern=_ID_PATTERN,
        description="The model a Jev client asks for (e.g. jev-latest). Recorded in the "
        "result as requested_model; the pipeline's engine answers whatever it names.",
    )
    state: Content = Field(
        description="What the questions are about: text, or a JSON object or array (read as "
        "its JSON text, as vLLM's decision reader writes it). Its length as text is limited "
        "by the worker's parse limits (max_state_chars, 32000 characters by default)."
    )
    questions: (
        Annotated[
            dict[str, Question],
            Field(
                min_length=1,
                max_length=MAX_QUESTIONS,
                json_schema_extra={"propertyNames": {"pattern": QUESTION_ID_PATTERN}},
            ),
        ]
        | None
    ) = Field(
        default=None,
        description="Question id -> question. Ids match ^[A-Za-z][A-Za-z0-9_]{0,63}$ (they are "
        "written into the answer template). Exactly one of questions and question_set.",
    )
    question_set: str | None = Field(
        default=None,
        min_length=1,
        max_length=128,
        description="Name of a question set configured on the workers, instead of questions.",
    )
    samples: int | Literal["auto"] = Field(
        default=1,
        description='Reads to average (1..16), or "auto": one read, more only while some '
        "question's entropy is above auto_threshold, up to auto_max.",
        json_schema_extra={
            "anyOf": [
                {"type": "integer", "minimum": MIN_SAMPLES, "maximum": MAX_SAMPLES},
                {"const": "auto", "type": "string"},
            ]
        },
    )
    auto_threshold: float | None = Field(
        default=None,
        gt=0,
        description='Entropy in nats above which "auto" takes another read. Only with "auto".',
    )
    auto_max: int | None = Field(
        default=None,
        ge=MIN_AUTO_MAX,
        le=MAX_SAMPLES,
        description='Most reads "auto" may take (2..16). Only with "auto".',
    )
    reply_topic: str | None = Field(
        default=None,
        pattern=TOPIC_PATTERN,
        description='Kafka topic for the result instead of the configured one; not "." or "..".',
    )
    metadata: dict[str, Any] = Field(
        default_factory=dict,
        description="Anything; echoed untouched in the result (nesting depth at most 64).",
    )
    instructions: Instructions | None = Field(
        default=None,
        description="Context for the questions (vLLM's request-level instructions): text, "
        "or JSON read as its text; at most 2000 characters, not blank. The prompt places it "
        "quoted at the start of the user's turn, ahead of the state and after the question "
        "list, which stays a prefix shared across requests.",
    )
    images: list[str] | None = Field(
        default=None,
        max_length=MAX_IMAGES,
        description="Images beside the state (vLLM's and openjev's shape): each an http(s) "
        "URL (fetched only where the pipeline allows it) or a data URL "
        "(data:image/<type>;base64,...). At most 8 in all, with input's and assets' images. "
        "Refused with IMAGES_NOT_READ until the pipeline's engine reads images.",
    )
    input: str | list[Annotated[InputPart, Field(discriminator="type")]] | None = Field(
        default=None,
        description="OpenAI moderation's input, in place of state: text, or parts "
        '{"type": "text", "text"} (joined by newlines, they are the state) and '
        '{"type": "image_url", "image_url": {"url"}} (images, as in images).',
    )
    assets: dict[str, JevAsset] | None = Field(
        default=None,
        min_length=1,
        description="Jev's image assets: placeholder -> {type: image, format, data_base64}. "
        "Jev's multipart part has no Kafka equivalent and is refused.",
    )
    # Not a field: set by `parse_request` when the id came from the record.
    _id_source: IdSource = PrivateAttr(default="request")
    # Not a field: set by `parse_request` for a request that came as a structured CloudEvent.
    _event: EventRef | None = PrivateAttr(default=None)
    # Not a field: the images' references, read once (`image_refs`).
    _image_refs: tuple[ImageRef, ...] | None = PrivateAttr(default=None)

    @property
    def id_source(self) -> IdSource:
        """Where `id` came from: "request" (the body), "event", "key" or "record" (see
        parse_request)."""
        return self._id_source

    @property
    def event(self) -> EventRef | None:
        """The structured-mode CloudEvent this request came in, or None."""
        return self._event

    @model_validator(mode="before")
    @classmethod
    def _state_from_input(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("input") is None:
            return data  # a null input (our own dump of a request) is no input
        if "state" in data:
            raise fail(
                ErrorCode.STATE_AND_INPUT,
                "give state or input (OpenAI moderation's, whose text is the state), not both",
                "input",
            )
        return {**data, "state": _input_text(data["input"])}

    @field_validator("instructions")
    @classmethod
    def _request_instructions_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise fail(ErrorCode.EMPTY_INSTRUCTIONS, "instructions are blank")
        return value

    @field_validator("input", mode="before")
    @classmethod
    def _input_parts(cls, value: Any) -> Any:
        if isinstance(value, list):
            for i, part in enumerate(value):
                if not isinstance(part, dict):
                    raise fail(
                        ErrorCode.WRONG_TYPE,
                        f"input parts are objects, got {json_type(part)}: OpenAI's list of "
                        "several inputs has no place here (one request is one input)",
                        f"input.{i}",
                    )
        return value

    @property
    def image_refs(self) -> tuple[ImageRef, ...]:
        """Every image of the request, in order: `images`, `input`'s image parts, `assets`."""
        if self._image_refs is None:
            self._image_refs = self._read_image_refs()
        return self._image_refs

    def _read_image_refs(self) -> tuple[ImageRef, ...]:
        refs = [check_reference(u, f"images.{i}") for i, u in enumerate(self.images or ())]
        if isinstance(self.input, list):
            refs += [
                check_reference(p.image_url.url, f"input.{i}.image_url.url")
                for i, p in enumerate(self.input)
                if isinstance(p, ImagePart)
            ]
        refs += [a.reference(f"assets.{k}") for k, a in (self.assets or {}).items()]
        return tuple(refs)

    @field_validator("state")
    @classmethod
    def _state_within_limit(cls, value: str, info: ValidationInfo) -> str:
        limits = _limits(info)
        if limits is not None and len(value) > limits.max_state_chars:
            raise fail(
                ErrorCode.STATE_TOO_LARGE,
                f"state has {len(value)} characters; the limit is {limits.max_state_chars}",
            )
        return value

    @field_validator("questions", mode="before")
    @classmethod
    def _check_question_ids(cls, value: Any, info: ValidationInfo) -> Any:
        if not isinstance(value, dict):
            return value  # None, or a wrong type reported by the type check
        if not value:
            raise fail(ErrorCode.NO_QUESTIONS, "questions is empty")
        limits = _limits(info)
        most = MAX_QUESTIONS if limits is None else min(MAX_QUESTIONS, limits.max_questions)
        if len(value) > most:
            raise fail(
                ErrorCode.TOO_MANY_QUESTIONS,
                f"{len(value)} questions; at most {most} are allowed",
            )
        for qid in value:
            if not isinstance(qid, str) or not is_question_id(qid):
                raise fail(
                    ErrorCode.INVALID_QUESTION_ID,
                    f"question id {qid!r} must match {QUESTION_ID_PATTERN}",
                    f"questions.{qid}",
                )
        return value

    @field_validator("samples", mode="before")
    @classmethod
    def _check_samples(cls, value: Any) -> Any:
        if value == "auto" and isinstance(value, str):
            return value
        if isinstance(value, bool) or not isinstance(value, int):
            raise fail(
                ErrorCode.WRONG_TYPE,
                f'samples must be an integer or "auto", got {json_type(value)} {value!r}',
            )
        if not MIN_SAMPLES <= value <= MAX_SAMPLES:
            raise fail(
                ErrorCode.INVALID_SAMPLES,
                f"samples must be {MIN_SAMPLES}..{MAX_SAMPLES}, got {value}",
            )
        return value

    @field_validator("reply_topic")
    @classmethod
    def _check_topic(cls, value: str | None) -> str | None:
        if value in (".", ".."):
            raise fail(ErrorCode.INVALID_REPLY_TOPIC, f"{value!r} is not a valid topic name")
        return value

    @field_validator("metadata")
    @classmethod
    def _check_metadata(cls, value: dict[str, Any]) -> dict[str, Any]:
        if json_depth(value, MAX_METADATA_DEPTH) > MAX_METADATA_DEPTH:
            raise fail(
                ErrorCode.INVALID_METADATA,
                f"metadata is nested more than {MAX_METADATA_DEPTH} levels deep",
            )
        return value

    @model_validator(mode="after")
    def _check_request(self) -> ClassificationRequest:
        if self.questions is None and self.question_set is None:
            raise fail(ErrorCode.NO_QUESTIONS, "give questions or question_set", "questions")
        if self.questions is not None and self.question_set is not None:
            raise fail(
                ErrorCode.QUESTIONS_AND_SET,
                "give questions or question_set, not both",
                "question_set",
            )
        if self.samples != "auto":
            for name in ("auto_threshold", "auto_max"):
                if getattr(self, name) is not None:
                    raise fail(
                        ErrorCode.INVALID_AUTO_OPTIONS,
                        f'{name} needs samples "auto" (samples is {self.samples})',
                        name,
                    )
        if self.questions is not None:
            problem = _graph_problem(self.questions)
            if problem is not None:
                raise fail(problem.code, problem.text, problem.field)
        if self.images is not None or self.input is not None or self.assets is not None:
            refs = self.image_refs  # each reference checked (INVALID_IMAGE_SOURCE)
            if len(refs) > MAX_IMAGES:
                raise fail(
                    ErrorCode.TOO_MANY_IMAGES,
                    f"{len(refs)} images in all (images, input, assets); at most "
                    f"{MAX_IMAGES} are allowed",
                    "images",
                )
        return self

    def stages(self) -> list[list[str]]:
        """`question_order` of this request's questions ([] for a question_set request)."""
        return question_order(self.questions) if self.questions is not None else []

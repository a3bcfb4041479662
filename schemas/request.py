"""Classification requests: a text (`state`) and the questions to answer about it.

Questions have the Jev API's shape and are told apart by `type`; a body as Jev's clients send
it (`POST /v1/systemone`: no `id`, a `model`, state and texts as JSON, null criteria) is a
request. They may depend on one another (`depends_on`: asked after those questions, with their
answers in the prompt) or be asked only when another question's answer is among given values
(`ask_if`, which implies the dependency).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    StringConstraints,
    ValidationInfo,
    field_validator,
    model_validator,
)

from schemas._common import LIMITS_CTX, RequestModel, fail, has_control, json_type
from schemas._version import SchemaVersion
from schemas.cloudevents import EventRef
from schemas.content import CONTENT_SCHEMA, NULL_LEVEL_NAME, Content, json_depth, to_text
from schemas.errors import ErrorCode, RequestRejected
from schemas.images import MAX_IMAGES, ImagePart, ImageRef, InputPart, JevAsset, check_reference
from schemas.names import (
    QUESTION_ID_PATTERN,
    TOPIC_PATTERN,
    is_question_id,
    label_defect,
    label_key,
)

QuestionKind = Literal["yes_no", "choice", "score"]
# Where a request's id came from: its body, the structured CloudEvent that carried it, the
# record's key, or the record's topic-partition-offset (see `schemas.parse.record_id`).
IdSource = Literal["request", "event", "key", "record"]

MAX_QUESTIONS = 64
MAX_ID_CHARS = 128
MAX_INSTRUCTIONS_CHARS = 2000
MAX_OPTION_CHARS = 64
# One read carries one single-token label per option, A..Z (vLLM 0.33's decision reader caps
# choices at 26 the same way); Jev itself takes up to 255 options.
MIN_OPTIONS, MAX_OPTIONS = 2, 26
JEV_MAX_OPTIONS = 255
MIN_LEVELS, MAX_LEVELS = 2, 10
MIN_SAMPLES, MAX_SAMPLES = 1, 16
MIN_AUTO_MAX = 2
# Metadata is echoed inside the result; deeper nesting cannot be serialized back reliably.
MAX_METADATA_DEPTH = 64
MAX_MODEL_CHARS = 128

_ID_PATTERN = r"^[^\x00-\x1F\x7F-\x9F]+$"
_YES_NO_ANSWERS = ("yes", "no")

# Option and level names are labels: the model is asked about them and a reviewer reads them
# (schemas.names: `label_defect`, `label_key`). The published schema and the errors say so.
_LABEL_RULES = (
    "without bidirectional controls or invisible characters (zero-width, soft hyphen, "
    "variation selectors, tags; a ZWJ or ZWNJ only where a script or an emoji joins with "
    "it), and unique as Unicode NFKC with case folded, spacing and invisible characters "
    "ignored."
)
_PLAIN = "a label must read as what it is"
_COMPARED = "names are compared as Unicode NFKC, ignoring case, spacing and invisible characters"


def _alike(name: str, other: str) -> str:
    """`name repeats other`, with their code points when the two would print alike."""
    if name != other and not (name.isascii() and other.isascii()):
        return f"{name!r} repeats {other!r}: {name!a} and {other!a}"
    return f"{name!r} repeats {other!r}"


_Instructions = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_INSTRUCTIONS_CHARS),
    BeforeValidator(to_text),
    CONTENT_SCHEMA,
]


# --- questions ----------------------------------------------------------------------------------


class _QuestionBase(RequestModel):
    type: str  # narrowed to a Literal by each kind; declared here so it comes first
    instructions: _Instructions | None = Field(
        default=None,
        description="What to decide: text, or a JSON object or array (read as its JSON text); "
        "at most 2000 characters as text, not blank. Null or left out: the question has no "
        "instruction line (a yes/no question then needs a described outcome).",
    )
    depends_on: list[str] = Field(
        default_factory=list,
        description="Ids of questions whose answers go into this question's prompt; this "
        "question is asked after them.",
    )
    ask_if: dict[str, list[str]] | None = Field(
        default=None,
        description="Question id -> answers of that question for which this one is asked "
        "(yes/no: 'yes'/'no'; choice: option names; score: level names). Implies the "
        "dependency. When not met, the answer is of type 'skipped'.",
    )

    @field_validator("instructions")
    @classmethod
    def _instructions_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise fail(ErrorCode.EMPTY_INSTRUCTIONS, "instructions are blank")
        return value

    @property
    def kind(self) -> QuestionKind:
        """The normalized kind: "yes_no" (for both "noul" and "yes_no"), "choice" or "score"."""
        raise NotImplementedError

    @property
    def answers(self) -> tuple[str, ...]:
        """The values an answer can take, in order (also what `ask_if` lists)."""
        raise NotImplementedError

    @property
    def labels(self) -> tuple[str, ...]:
        """Same as `answers`: answer names, not the label tokens the engine writes."""
        return self.answers

    @property
    def prerequisites(self) -> tuple[str, ...]:
        """Ids this question waits for: `depends_on`, then `ask_if` keys, without repeats."""
        return tuple(dict.fromkeys([*self.depends_on, *(self.ask_if or {})]))


class YesNoCriteria(RequestModel):
    """What `yes` and what `no` mean (either may be left out or null; text or JSON)."""

    true: Content | None = None
    false: Content | None = None


class YesNoQuestion(_QuestionBase):
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
    def kind(self) -> QuestionKind:
        return "yes_no"

    @property
    def answers(self) -> tuple[str, ...]:
        return _YES_NO_ANSWERS


class ChoiceQuestion(_QuestionBase):
    """Pick one of 2..26 named options (Jev takes 255; one read carries 26 labels)."""

    type: Literal["choice"]
    criteria: dict[str, Content | None] = Field(
        min_length=MIN_OPTIONS,
        max_length=MAX_OPTIONS,
        description="Option name -> description (text, JSON read as its text, or null), in "
        "order. 2..26 options: one read carries one single-token label per option (A..Z). "
        "Names are not blank, at most 64 characters, " + _LABEL_RULES,
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
        seen: dict[str, str] = {}
        for name in value:
            stripped = name.strip()
            if not stripped or len(name) > MAX_OPTION_CHARS or has_control(name):
                raise fail(
                    ErrorCode.INVALID_OPTION_NAME,
                    f"option name {name!r} must be 1..{MAX_OPTION_CHARS} characters, not blank, "
                    "without control characters",
                )
            defect = label_defect(name)
            if defect is not None:
                raise fail(
                    ErrorCode.INVALID_OPTION_NAME,
                    f"option name {name!r} holds {defect}: {_PLAIN}",
                )
            key = label_key(name)
            if key in seen:
                raise fail(
                    ErrorCode.DUPLICATE_OPTION,
                    f"option {_alike(name, seen[key])} ({_COMPARED})",
                )
            seen[key] = name
        return value

    @property
    def kind(self) -> QuestionKind:
        return "choice"

    @property
    def answers(self) -> tuple[str, ...]:
        return tuple(self.criteria)


def level_names(levels: Sequence[str | None]) -> tuple[str, ...]:
    """The names of a score's levels: a null level is named by its 0-based position."""
    return tuple(
        NULL_LEVEL_NAME.format(i) if level is None else level for i, level in enumerate(levels)
    )


class ScoreQuestion(_QuestionBase):
    """Place the state on an ordered scale of 2..10 levels, lowest first."""

    type: Literal["score"]
    criteria: list[Content | None] = Field(
        min_length=MIN_LEVELS,
        max_length=MAX_LEVELS,
        description="Level names (text, JSON read as its text, or null), lowest first; "
        'numbered 1..n in results. A null level is named "level <i>" with i its 0-based '
        "position (its Jev score). Names are not blank, " + _LABEL_RULES,
    )

    @field_validator("criteria")
    @classmethod
    def _check_levels(cls, value: list[str | None]) -> list[str | None]:
        seen: dict[str, str] = {}
        names = level_names(value)
        for level in names:
            stripped = level.strip()
            if not stripped or has_control(level):
                raise fail(
                    ErrorCode.INVALID_LEVEL_NAME,
                    f"level name {level!r} must not be blank or hold control characters",
                )
            defect = label_defect(level)
            if defect is not None:
                raise fail(
                    ErrorCode.INVALID_LEVEL_NAME,
                    f"level name {level!r} holds {defect}: {_PLAIN}",
                )
            key = label_key(level)
            if key in seen:
                null = " (a null level is named by its 0-based position)" if None in value else ""
                raise fail(
                    ErrorCode.DUPLICATE_LEVEL,
                    f"level {_alike(level, seen[key])} ({_COMPARED}){null}",
                )
            seen[key] = level
        return value

    @property
    def kind(self) -> QuestionKind:
        return "score"

    @property
    def answers(self) -> tuple[str, ...]:
        return level_names(self.criteria)


Question = Annotated[YesNoQuestion | ChoiceQuestion | ScoreQuestion, Field(discriminator="type")]
QUESTION_TYPES: tuple[str, ...] = ("noul", "yes_no", "choice", "score")


# --- the dependency graph -----------------------------------------------------------------------


class _Problem(NamedTuple):
    code: ErrorCode
    text: str
    field: str


def _graph_problem(questions: Mapping[str, _QuestionBase]) -> _Problem | None:
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


def _find_cycle(questions: Mapping[str, _QuestionBase]) -> list[str] | None:
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


def question_order(questions: Mapping[str, _QuestionBase]) -> list[list[str]]:
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
    instructions: _Instructions | None = Field(
        default=None,
        description="Context placed ahead of the questions (vLLM's request-level "
        "instructions): text, or JSON read as its text; at most 2000 characters, not blank. "
        "Refused with INSTRUCTIONS_NOT_READ until the pipeline's prompt places it.",
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

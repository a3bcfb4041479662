"""The wire contract: what parses, what is refused (with which code and field), and shapes out."""

from __future__ import annotations

import base64
import copy
import json
import pickle
import random
from datetime import UTC, datetime, timedelta, timezone
from typing import Any

import pytest
from pydantic import ValidationError

from dgstream.schemas import (
    DEFAULT_LIMITS,
    SCHEMA_VERSION,
    ChoiceAnswer,
    ChoiceQuestion,
    ClassificationRequest,
    ClassificationResult,
    DeadLetter,
    Diagnostics,
    ErrorCode,
    FallbackId,
    ParseLimits,
    RequestError,
    RequestRejected,
    ScoreAnswer,
    ScoreQuestion,
    SkippedAnswer,
    YesNoAnswer,
    YesNoQuestion,
    parse_request,
    question_order,
    record_id,
    request_id_hint,
)

pytestmark = pytest.mark.unit

DROP = object()  # a value that removes the key
_KEEP = object()


def yes_no(**extra: Any) -> dict[str, Any]:
    return {"type": "noul", "instructions": "Is the message toxic?", **extra}


def choice(n: int = 3, **extra: Any) -> dict[str, Any]:
    options = {f"Option {i}": (f"the {i}th" if i % 2 else None) for i in range(n)}
    return {"type": "choice", "instructions": "Which topic?", "criteria": options, **extra}


def score(levels: list[Any] | None = None, **extra: Any) -> dict[str, Any]:
    levels = ["low", "medium", "high"] if levels is None else levels
    return {"type": "score", "instructions": "How severe?", "criteria": levels, **extra}


def request(questions: Any = _KEEP, **fields: Any) -> dict[str, Any]:
    """A good request with `fields` replaced (DROP removes one)."""
    body: dict[str, Any] = {
        "id": "req-1",
        "state": "Some text to classify.",
        "questions": {"toxic": yes_no()},
    }
    if questions is not _KEEP:
        fields["questions"] = questions
    for key, value in fields.items():
        if value is DROP:
            body.pop(key, None)
        else:
            body[key] = value
    return body


def enc(obj: Any) -> bytes:
    try:
        return json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate: only the \\uXXXX escape can carry it
        return json.dumps(obj).encode()


def nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {}
    for _ in range(depth - 1):
        value = {"a": value}
    return value


# --- refused requests ---------------------------------------------------------------------------

E = ErrorCode
_TWO = {"a": yes_no(), "b": yes_no()}


def _bad(
    name: str, raw: Any, code: ErrorCode, field: str | None, limits: ParseLimits | None = None
):
    data = raw if raw is None or isinstance(raw, bytes) else enc(raw)
    return pytest.param(data, code, field, limits or DEFAULT_LIMITS, id=name)


BAD = [
    # parse
    _bad("empty-message", b"", E.EMPTY_MESSAGE, None),
    _bad("null-message", None, E.EMPTY_MESSAGE, None),
    _bad(
        "oversize-message",
        request(state="x" * 500),
        E.MESSAGE_TOO_LARGE,
        None,
        ParseLimits(max_message_bytes=200),
    ),
    _bad("non-utf8", b'{"id": "r\xff\xfe", "state": "x"}', E.INVALID_UTF8, None),
    _bad("invalid-json", b'{"id": "r1", "state": ', E.INVALID_JSON, None),
    _bad("whitespace-only", b"  \n", E.INVALID_JSON, None),
    _bad("nan", b'{"id": "r", "state": "x", "auto_threshold": NaN}', E.INVALID_JSON, None),
    _bad(
        "infinity", b'{"id": "r", "state": "x", "metadata": {"v": -Infinity}}', E.INVALID_JSON, None
    ),
    _bad(
        "overflowing-number",
        b'{"id": "r", "state": "x", "metadata": {"v": 1e400}}',
        E.INVALID_JSON,
        None,
    ),
    _bad("duplicate-keys", b'{"id": "a", "id": "b", "state": "x"}', E.INVALID_JSON, None),
    _bad(
        "cloudevent-wrong-specversion",
        {"specversion": "0.3", "id": "e", "source": "/s", "type": "t", "data": request()},
        E.INVALID_CLOUDEVENT,
        "specversion",
    ),
    _bad(
        "duplicate-nested-keys",
        b'{"id": "a", "state": "x", "metadata": {"k": 1, "k": 2}}',
        E.INVALID_JSON,
        None,
    ),
    _bad("json-nested-too-deep", b"[" * 100_000 + b"]" * 100_000, E.INVALID_JSON, None),
    _bad(
        "lone-surrogate-question-id",
        request({"\ud800": yes_no()}),
        E.INVALID_UNICODE,
        "questions.\\ud800",
    ),
    _bad("lone-surrogate-state", request(state="ok \udfff"), E.INVALID_UNICODE, "state"),
    _bad("top-level-array", [request()], E.NOT_AN_OBJECT, None),
    _bad("top-level-string", "hello", E.NOT_AN_OBJECT, None),
    _bad(
        "schema-version-2",
        request(schema_version=2),
        E.UNSUPPORTED_SCHEMA_VERSION,
        "schema_version",
    ),
    _bad(
        "schema-version-string",
        request(schema_version="1"),
        E.UNSUPPORTED_SCHEMA_VERSION,
        "schema_version",
    ),
    _bad(
        "schema-version-true",
        request(schema_version=True),
        E.UNSUPPORTED_SCHEMA_VERSION,
        "schema_version",
    ),
    # contract: top level
    _bad("missing-id", request(id=DROP), E.MISSING_FIELD, "id"),
    _bad("missing-state", request(state=DROP), E.MISSING_FIELD, "state"),
    _bad("id-too-long", request(id="x" * 129), E.ID_TOO_LONG, "id"),
    _bad("empty-id", request(id=""), E.INVALID_ID, "id"),
    _bad("id-control-char", request(id="req\u00071"), E.INVALID_ID, "id"),
    _bad("id-newline", request(id="req\n1"), E.INVALID_ID, "id"),
    _bad("id-number", request(id=17), E.WRONG_TYPE, "id"),
    _bad("state-number", request(state=42), E.WRONG_TYPE, "state"),
    _bad("state-null", request(state=None), E.WRONG_TYPE, "state"),
    _bad(
        "state-over-limit",
        request(state="x" * 11),
        E.STATE_TOO_LARGE,
        "state",
        ParseLimits(max_state_chars=10),
    ),
    _bad("unknown-top-level-field", request(colour="red"), E.UNKNOWN_FIELD, "colour"),
    _bad("empty-questions", request({}), E.NO_QUESTIONS, "questions"),
    _bad("neither-questions-nor-set", request(DROP), E.NO_QUESTIONS, "questions"),
    _bad(
        "questions-and-set", request(question_set="moderation"), E.QUESTIONS_AND_SET, "question_set"
    ),
    _bad("empty-question-set", request(DROP, question_set=""), E.INVALID_VALUE, "question_set"),
    _bad("questions-as-list", request([yes_no()]), E.WRONG_TYPE, "questions"),
    _bad(
        "too-many-questions",
        request({f"q{i}": yes_no() for i in range(65)}),
        E.TOO_MANY_QUESTIONS,
        "questions",
    ),
    _bad(
        "more-questions-than-limit",
        request({f"q{i}": yes_no() for i in range(3)}),
        E.TOO_MANY_QUESTIONS,
        "questions",
        ParseLimits(max_questions=2),
    ),
    _bad("question-id-space", request({"q 1": yes_no()}), E.INVALID_QUESTION_ID, "questions.q 1"),
    _bad(
        "question-id-digit-first", request({"1q": yes_no()}), E.INVALID_QUESTION_ID, "questions.1q"
    ),
    _bad(
        "question-id-65-chars",
        request({"q" * 65: yes_no()}),
        E.INVALID_QUESTION_ID,
        "questions." + "q" * 65,
    ),
    _bad("question-id-non-ascii", request({"qé": yes_no()}), E.INVALID_QUESTION_ID, "questions.qé"),
    _bad("samples-many", request(samples="many"), E.WRONG_TYPE, "samples"),
    _bad("samples-bool", request(samples=True), E.WRONG_TYPE, "samples"),
    _bad("samples-float", request(samples=2.0), E.WRONG_TYPE, "samples"),
    _bad("samples-0", request(samples=0), E.INVALID_SAMPLES, "samples"),
    _bad("samples-17", request(samples=17), E.INVALID_SAMPLES, "samples"),
    _bad("auto-max-without-auto", request(auto_max=4), E.INVALID_AUTO_OPTIONS, "auto_max"),
    _bad(
        "auto-threshold-without-auto",
        request(samples=3, auto_threshold=0.5),
        E.INVALID_AUTO_OPTIONS,
        "auto_threshold",
    ),
    _bad(
        "auto-threshold-zero",
        request(samples="auto", auto_threshold=0),
        E.INVALID_AUTO_OPTIONS,
        "auto_threshold",
    ),
    _bad("auto-max-1", request(samples="auto", auto_max=1), E.INVALID_AUTO_OPTIONS, "auto_max"),
    _bad("auto-max-17", request(samples="auto", auto_max=17), E.INVALID_AUTO_OPTIONS, "auto_max"),
    _bad("auto-max-string", request(samples="auto", auto_max="4"), E.WRONG_TYPE, "auto_max"),
    _bad("reply-topic-slash", request(reply_topic="out/put"), E.INVALID_REPLY_TOPIC, "reply_topic"),
    _bad("reply-topic-dotdot", request(reply_topic=".."), E.INVALID_REPLY_TOPIC, "reply_topic"),
    _bad(
        "reply-topic-250-chars",
        request(reply_topic="t" * 250),
        E.INVALID_REPLY_TOPIC,
        "reply_topic",
    ),
    _bad("metadata-list", request(metadata=[1, 2]), E.INVALID_METADATA, "metadata"),
    _bad("metadata-too-deep", request(metadata=nested(65)), E.INVALID_METADATA, "metadata"),
    # contract: questions
    _bad(
        "unknown-question-kind",
        request({"toxic": yes_no(type="yesno")}),
        E.UNKNOWN_QUESTION_KIND,
        "questions.toxic.type",
    ),
    _bad(
        "question-kind-number",
        request({"toxic": yes_no(type=3)}),
        E.UNKNOWN_QUESTION_KIND,
        "questions.toxic.type",
    ),
    _bad(
        "question-without-type",
        request({"toxic": {"instructions": "?"}}),
        E.MISSING_FIELD,
        "questions.toxic.type",
    ),
    _bad(
        "question-not-object", request({"toxic": "Is it toxic?"}), E.WRONG_TYPE, "questions.toxic"
    ),
    _bad(
        "choice-missing-criteria",
        request({"t": {"type": "choice", "instructions": "?"}}),
        E.MISSING_FIELD,
        "questions.t.criteria",
    ),
    _bad(
        "unknown-question-field",
        request({"toxic": yes_no(weight=2)}),
        E.UNKNOWN_FIELD,
        "questions.toxic.weight",
    ),
    _bad(
        "unknown-yes-no-criterion",
        request({"toxic": yes_no(criteria={"maybe": "?"})}),
        E.UNKNOWN_FIELD,
        "questions.toxic.criteria.maybe",
    ),
    _bad(
        "empty-instructions",
        request({"toxic": yes_no(instructions="")}),
        E.EMPTY_INSTRUCTIONS,
        "questions.toxic.instructions",
    ),
    _bad(
        "blank-instructions",
        request({"toxic": yes_no(instructions=" \n\t")}),
        E.EMPTY_INSTRUCTIONS,
        "questions.toxic.instructions",
    ),
    _bad(
        "instructions-too-long",
        request({"toxic": yes_no(instructions="x" * 2001)}),
        E.INSTRUCTIONS_TOO_LONG,
        "questions.toxic.instructions",
    ),
    _bad(
        "choice-1-option",
        request({"topic": choice(1)}),
        E.TOO_FEW_OPTIONS,
        "questions.topic.criteria",
    ),
    _bad(
        "choice-27-options",
        request({"topic": choice(27)}),
        E.TOO_MANY_OPTIONS,
        "questions.topic.criteria",
    ),
    _bad(
        "choice-duplicate-option",
        request({"topic": choice(criteria={"Spam": None, " spam": "x"})}),
        E.DUPLICATE_OPTION,
        "questions.topic.criteria",
    ),
    _bad(
        "choice-blank-option",
        request({"topic": choice(criteria={"a": None, "  ": None})}),
        E.INVALID_OPTION_NAME,
        "questions.topic.criteria",
    ),
    _bad(
        "choice-65-char-option",
        request({"topic": choice(criteria={"a": None, "b" * 65: None})}),
        E.INVALID_OPTION_NAME,
        "questions.topic.criteria",
    ),
    _bad(
        "choice-criteria-list",
        request({"topic": choice(criteria=["a", "b"])}),
        E.WRONG_TYPE,
        "questions.topic.criteria",
    ),
    _bad(
        "choice-description-number",
        request({"topic": choice(criteria={"a": 1, "b": None})}),
        E.WRONG_TYPE,
        "questions.topic.criteria.a",
    ),
    _bad(
        "score-1-level",
        request({"sev": score(["only"])}),
        E.TOO_FEW_LEVELS,
        "questions.sev.criteria",
    ),
    _bad(
        "score-11-levels",
        request({"sev": score([f"l{i}" for i in range(11)])}),
        E.TOO_MANY_LEVELS,
        "questions.sev.criteria",
    ),
    _bad(
        "score-duplicate-level",
        request({"sev": score(["low", "high", "Low"])}),
        E.DUPLICATE_LEVEL,
        "questions.sev.criteria",
    ),
    _bad(
        "score-blank-level",
        request({"sev": score(["low", ""])}),
        E.INVALID_LEVEL_NAME,
        "questions.sev.criteria",
    ),
    _bad(
        "score-level-number",
        request({"sev": score(["low", 2])}),
        E.WRONG_TYPE,
        "questions.sev.criteria.1",
    ),
    _bad(
        "depends-on-not-list",
        request({"toxic": yes_no(depends_on="x")}),
        E.WRONG_TYPE,
        "questions.toxic.depends_on",
    ),
    # graph
    _bad(
        "self-dependency",
        request({"toxic": yes_no(depends_on=["toxic"])}),
        E.DEPENDENCY_CYCLE,
        "questions.toxic.depends_on",
    ),
    _bad(
        "self-ask-if",
        request({"toxic": yes_no(ask_if={"toxic": ["yes"]})}),
        E.DEPENDENCY_CYCLE,
        "questions.toxic.ask_if",
    ),
    _bad(
        "depends-on-cycle",
        request({"a": yes_no(depends_on=["b"]), "b": yes_no(depends_on=["a"])}),
        E.DEPENDENCY_CYCLE,
        "questions.a.depends_on",
    ),
    _bad(
        "cycle-through-ask-if",
        request(
            {
                "a": yes_no(depends_on=["b"]),
                "b": yes_no(ask_if={"c": ["no"]}),
                "c": yes_no(depends_on=["a"]),
                "d": yes_no(),
            }
        ),
        E.DEPENDENCY_CYCLE,
        "questions.a.depends_on",
    ),
    _bad(
        "unknown-dependency",
        request({"toxic": yes_no(depends_on=["spam"])}),
        E.UNKNOWN_DEPENDENCY,
        "questions.toxic.depends_on",
    ),
    _bad(
        "ask-if-unknown-question",
        request({"toxic": yes_no(ask_if={"spam": ["yes"]})}),
        E.UNKNOWN_DEPENDENCY,
        "questions.toxic.ask_if",
    ),
    _bad(
        "ask-if-value-not-an-answer",
        request({"spam": yes_no(), "toxic": yes_no(ask_if={"spam": ["maybe"]})}),
        E.INVALID_ASK_IF_VALUE,
        "questions.toxic.ask_if.spam",
    ),
    _bad(
        "ask-if-option-wrong-case",
        request({"topic": choice(2), "t": yes_no(ask_if={"topic": ["option 1"]})}),
        E.INVALID_ASK_IF_VALUE,
        "questions.t.ask_if.topic",
    ),
    _bad(
        "ask-if-level-unknown",
        request({"sev": score(), "t": yes_no(ask_if={"sev": ["extreme"]})}),
        E.INVALID_ASK_IF_VALUE,
        "questions.t.ask_if.sev",
    ),
    _bad(
        "ask-if-no-values",
        request({"spam": yes_no(), "t": yes_no(ask_if={"spam": []})}),
        E.INVALID_ASK_IF_VALUE,
        "questions.t.ask_if.spam",
    ),
    # Jev's forms, where they still cannot be answered
    _bad(
        "noul-without-instructions-or-outcome",
        request({"t": {"type": "noul"}}),
        E.EMPTY_INSTRUCTIONS,
        "questions.t.instructions",
    ),
    _bad(
        "noul-null-instructions-null-outcomes",
        request({"t": yes_no(instructions=None, criteria={"true": None, "false": None})}),
        E.EMPTY_INSTRUCTIONS,
        "questions.t.instructions",
    ),
    _bad(
        "instructions-number",
        request({"t": yes_no(instructions=3)}),
        E.WRONG_TYPE,
        "questions.t.instructions",
    ),
    _bad(
        "instructions-json-too-long-as-text",
        request({"t": yes_no(instructions={"task": "x" * 1990})}),
        E.INSTRUCTIONS_TOO_LONG,
        "questions.t.instructions",
    ),
    _bad(
        "instructions-json-too-deep",
        request({"t": yes_no(instructions=nested(65))}),
        E.INVALID_VALUE,
        "questions.t.instructions",
    ),
    _bad(
        "state-json-over-limit-as-text",
        request(state={"m": "x" * 4}),
        E.STATE_TOO_LARGE,
        "state",
        ParseLimits(max_state_chars=10),
    ),
    _bad("state-json-too-deep", request(state=nested(65)), E.INVALID_VALUE, "state"),
    _bad("state-boolean", request(state=True), E.WRONG_TYPE, "state"),
    _bad("model-number", request(model=4), E.WRONG_TYPE, "model"),
    _bad("model-empty", request(model=""), E.INVALID_VALUE, "model"),
    _bad("model-129-chars", request(model="m" * 129), E.INVALID_VALUE, "model"),
    _bad("model-newline", request(model="jev\nlatest"), E.INVALID_VALUE, "model"),
    _bad(
        "choice-255-options-as-jev-allows",
        request({"topic": choice(255)}),
        E.TOO_MANY_OPTIONS,
        "questions.topic.criteria",
    ),
    _bad(
        "choice-description-too-deep",
        request({"topic": choice(criteria={"a": nested(65), "b": None})}),
        E.INVALID_VALUE,
        "questions.topic.criteria.a",
    ),
    _bad(
        "noul-criteria-number",
        request({"t": yes_no(criteria={"true": 1})}),
        E.WRONG_TYPE,
        "questions.t.criteria.true",
    ),
    _bad(
        "score-null-level-named-like-another",
        request({"sev": score(["level 1", None])}),
        E.DUPLICATE_LEVEL,
        "questions.sev.criteria",
    ),
    _bad(
        "score-level-named-like-a-null-one",
        request({"sev": score([None, "Level 0"])}),
        E.DUPLICATE_LEVEL,
        "questions.sev.criteria",
    ),
    _bad(
        "score-json-levels-equal-as-text",
        request({"sev": score([{"a": 1}, '{"a": 1}'])}),
        E.DUPLICATE_LEVEL,
        "questions.sev.criteria",
    ),
    # images beside the state (tests/workers/images: what the worker checks of their bytes)
    _bad("state-and-input", request(input="x"), E.STATE_AND_INPUT, "input"),
    _bad(
        "too-many-images",
        request(images=["https://example.com/a.png"] * 9),
        E.TOO_MANY_IMAGES,
        "images",
    ),
    _bad(
        "image-not-a-url",
        request(images=["ftp://example.com/a"]),
        E.INVALID_IMAGE_SOURCE,
        "images.0",
    ),
]


@pytest.mark.parametrize(("raw", "code", "field", "limits"), BAD)
def test_bad_request_is_refused_with_code_and_field(
    raw: bytes | None, code: ErrorCode, field: str | None, limits: ParseLimits
) -> None:
    err = parse_request(raw, limits)
    assert isinstance(err, RequestError), err
    assert err.code is code, err.message
    assert err.field == field, err.message
    if field is not None:
        assert field in err.message
    assert err.message


def test_table_is_large_and_covers_most_codes() -> None:
    assert len(BAD) >= 30
    covered = {p.values[1] for p in BAD}
    raised_later = {
        E.UNKNOWN_QUESTION_SET,
        E.LABEL_NOT_SINGLE_TOKEN,
        E.LABEL_POSITION_MISMATCH,
        E.DUPLICATE_LABEL_TOKEN,
        E.TEMPLATE_TOO_LONG,
        E.ENGINE_FAILED,
        # the worker's, once the request was read: tests/workers
        E.POISON,
        E.OUTPUT_TOO_LARGE,
        E.REPLY_TOPIC_NOT_ALLOWED,
        E.REPLY_TOPIC_UNKNOWN,
        E.REPLY_TOPIC_NOT_WRITABLE,
        # the consumer's bound, before the value is parsed: tests/workers/test_bombs.py
        E.BATCH_TOO_LARGE,
        # the framing's, before parse_request: tests/schemas/test_framing.py and
        # tests/workers/test_schema_registry.py
        E.NOT_FRAMED,
        E.SCHEMA_ID_UNKNOWN,
        E.SCHEMA_NOT_JSON,
        # the worker's checks of a request's images and inputs: tests/workers/images
        E.IMAGE_UNREADABLE,
        E.IMAGE_TRUNCATED,
        E.IMAGE_TOO_LARGE,
        E.IMAGE_URL_NOT_ALLOWED,
        E.IMAGE_FETCH_FAILED,
        E.IMAGE_FETCH_TIMEOUT,
        E.IMAGE_WRONG_CONTENT_TYPE,
        E.IMAGES_NOT_READ,
        # reserved, no longer produced: every engine's prompt places request-level
        # instructions (tests/workers/test_images.py, tests/workers/engine/test_instructions.py)
        E.INSTRUCTIONS_NOT_READ,
    }
    assert set(ErrorCode) - raised_later == covered


def test_error_codes_are_the_documented_enumeration() -> None:
    spec = """EMPTY_MESSAGE MESSAGE_TOO_LARGE INVALID_UTF8 INVALID_JSON INVALID_UNICODE
    NOT_AN_OBJECT UNSUPPORTED_SCHEMA_VERSION MISSING_FIELD UNKNOWN_FIELD WRONG_TYPE INVALID_ID
    ID_TOO_LONG
    STATE_TOO_LARGE NO_QUESTIONS QUESTIONS_AND_SET TOO_MANY_QUESTIONS INVALID_QUESTION_ID
    UNKNOWN_QUESTION_KIND EMPTY_INSTRUCTIONS TOO_FEW_OPTIONS TOO_MANY_OPTIONS DUPLICATE_OPTION
    INVALID_OPTION_NAME TOO_FEW_LEVELS TOO_MANY_LEVELS DUPLICATE_LEVEL UNKNOWN_DEPENDENCY
    DEPENDENCY_CYCLE INVALID_ASK_IF_VALUE INVALID_SAMPLES INVALID_AUTO_OPTIONS INVALID_REPLY_TOPIC
    INVALID_METADATA INVALID_VALUE UNKNOWN_QUESTION_SET LABEL_NOT_SINGLE_TOKEN
    LABEL_POSITION_MISMATCH DUPLICATE_LABEL_TOKEN TEMPLATE_TOO_LONG ENGINE_FAILED""".split()
    names = {c.name for c in ErrorCode}
    assert set(spec) <= names
    doc = ErrorCode.__doc__ or ""
    for c in ErrorCode:
        assert c.value == c.name
        assert c.name in doc, f"{c.name} is not documented in ErrorCode's docstring"


def test_first_error_is_deterministic() -> None:
    body = request({"toxic": yes_no(type="bogus")}, id="", samples=0, colour=1)
    first = parse_request(enc(body))
    for _ in range(5):
        assert parse_request(enc(body)) == first
    assert isinstance(first, RequestError)
    assert first.field == "id"


def test_parse_never_raises_on_mangled_input() -> None:
    rnd = random.Random(1234)
    seed = enc(
        request(
            {"a": yes_no(), "b": choice(3, ask_if={"a": ["yes"]}), "c": score(depends_on=["b"])},
            samples="auto",
            metadata={"k": [1, 2.5, None, "ü"]},
        )
    )
    outcomes = set()
    for _ in range(600):
        data = bytearray(seed)
        for _ in range(rnd.randint(1, 4)):
            op = rnd.random()
            pos = rnd.randrange(len(data))
            if op < 0.4:
                data[pos] = rnd.randrange(256)
            elif op < 0.7:
                del data[pos : pos + rnd.randint(1, 8)]
            else:
                data[pos:pos] = rnd.choice([b"{", b"}", b"[", b'"', b",", b"null", b"\\u0000"])
        result = parse_request(bytes(data))
        assert isinstance(result, ClassificationRequest | RequestError)
        outcomes.add(
            type(result).__name__ if isinstance(result, ClassificationRequest) else result.code
        )
    assert len(outcomes) > 3  # the mutations reached several different checks


# --- accepted requests ----------------------------------------------------------------------------

GOOD = [
    pytest.param(request({"toxic": yes_no(type="yes_no")}), id="yes-no"),
    pytest.param(
        request({"toxic": yes_no(criteria={"true": "insults or threats", "false": None})}),
        id="noul-with-criteria",
    ),
    pytest.param(request({"toxic": yes_no(criteria={"false": "polite"})}), id="noul-one-sided"),
    pytest.param(request({"topic": choice(5)}), id="choice"),
    pytest.param(request({"sev": score(["none", "mild", "severe"])}), id="score"),
    pytest.param(
        request(
            DROP,
            question_set="moderation",
            samples="auto",
            auto_threshold=0.4,
            auto_max=8,
            reply_topic="replies.team-a_v2",
        ),
        id="question-set-auto",
    ),
    pytest.param(request(samples="auto"), id="auto-defaults"),
    pytest.param(request(samples=16, schema_version=1), id="explicit-version-max-samples"),
    pytest.param(
        request(
            {
                "lang": choice(criteria={"English": None, "French": "français", "Other": None}),
                "toxic": yes_no(depends_on=["lang"]),
                "sev": score(["low", "high"], ask_if={"toxic": ["yes"]}),
                "target": choice(
                    criteria={"person": None, "group": None},
                    depends_on=["lang"],
                    ask_if={"sev": ["high"], "lang": ["English", "Other"]},
                ),
            }
        ),
        id="depends-on-and-ask-if",
    ),
    pytest.param(
        request(
            id="réq-✓-1",
            state='Zeile eins\nligne deux 🙂 — \u00a0\t"quoted" \\ back',
            metadata={
                "trace": {"span": [1, 2.5, -3e-7, True, None, {"deep": ["x", {"y": "ÿ"}]}]},
                "user": "名前",
                "empty": {},
                "big": 10**30,
            },
        ),
        id="metadata-nested-unicode",
    ),
    pytest.param(
        request(
            {f"q{i}": yes_no() for i in range(64)},
            id="x" * 128,
            metadata=nested(64),
        ),
        id="at-the-limits",
    ),
    pytest.param(
        request({"topic": choice(26), "sev": score([f"L{i}" for i in range(10)])}),
        id="26-options-10-levels",
    ),
]


@pytest.mark.parametrize("body", GOOD)
def test_good_request_round_trips(body: dict[str, Any]) -> None:
    raw = enc(body)
    parsed = parse_request(raw)
    assert isinstance(parsed, ClassificationRequest), parsed
    again = json.loads(parsed.model_dump_json(exclude_unset=True))
    assert again == body
    # and once more through the parser
    assert parse_request(parsed.model_dump_json(exclude_unset=True).encode()) == parsed


def test_defaults_and_question_helpers() -> None:
    body = request(
        {"a": yes_no(), "b": yes_no(type="yes_no"), "c": choice(3), "d": score(["lo", "hi"])}
    )
    req = parse_request(enc(body))
    assert isinstance(req, ClassificationRequest)
    assert req.schema_version == SCHEMA_VERSION == 1
    assert req.samples == 1 and req.metadata == {} and req.reply_topic is None
    q = req.questions
    assert q is not None
    assert isinstance(q["a"], YesNoQuestion) and q["a"].type == "noul"
    assert [q[k].kind for k in "abcd"] == ["yes_no", "yes_no", "choice", "score"]
    assert q["a"].answers == q["b"].labels == ("yes", "no")
    assert isinstance(q["c"], ChoiceQuestion)
    assert q["c"].answers == ("Option 0", "Option 1", "Option 2")
    assert isinstance(q["d"], ScoreQuestion)
    assert q["d"].labels == ("lo", "hi")
    full = json.loads(req.model_dump_json())
    assert full["samples"] == 1 and full["questions"]["a"]["depends_on"] == []


def test_models_are_frozen() -> None:
    req = parse_request(enc(request()))
    assert isinstance(req, ClassificationRequest)
    with pytest.raises(ValidationError):
        req.id = "other"  # type: ignore[misc]


def test_limits_without_parse_context_and_limit_bounds() -> None:
    # Trusted code building a request directly is not held to the parse limits on state.
    req = ClassificationRequest.model_validate(request(state="x" * 100_000))
    assert len(req.state) == 100_000
    with pytest.raises(ValidationError):
        ParseLimits(max_questions=65)
    spec = ParseLimits(max_message_bytes=1 << 20, max_state_chars=32_000, max_questions=64)
    assert spec == DEFAULT_LIMITS


def test_str_input_is_accepted_as_utf8() -> None:
    parsed = parse_request(json.dumps(request()))  # type: ignore[arg-type]  # on purpose
    assert isinstance(parsed, ClassificationRequest)


# --- Jev's request bodies -----------------------------------------------------------------------


def jev_body(**fields: Any) -> dict[str, Any]:
    """A body as Jev's clients send `POST /v1/systemone`: no id, a model."""
    body: dict[str, Any] = {
        "state": "I was charged twice. Please help.",
        "model": "jev-latest",
        "questions": {"billing": {"type": "noul", "instructions": "Is this about billing?"}},
    }
    body.update(fields)
    return body


KEYED = FallbackId("order-17", "key")

# (body, what the parsed request reads as: a path into the model -> its text)
JEV_GOOD = [
    pytest.param(jev_body(), {"id": "order-17", "model": "jev-latest"}, id="plain"),
    pytest.param(
        jev_body(state={"message": "Please help.", "subject": "Duplicate charge", "n": [1, 2.5]}),
        {"state": '{"message": "Please help.", "subject": "Duplicate charge", "n": [1, 2.5]}'},
        id="state-object",
    ),
    pytest.param(
        jev_body(state=["ünï", {"k": None}, True]),
        {"state": '["ünï", {"k": null}, true]'},
        id="state-array-not-ascii-escaped",
    ),
    pytest.param(
        jev_body(questions={"b": {"type": "noul", "instructions": {"task": "billing?"}}}),
        {"questions.b.instructions": '{"task": "billing?"}'},
        id="instructions-json",
    ),
    pytest.param(
        jev_body(questions={"b": {"type": "noul", "criteria": {"true": "Unsolicited ads"}}}),
        {"questions.b.instructions": None, "questions.b.criteria.true": "Unsolicited ads"},
        id="noul-no-instructions-described-outcome",
    ),
    pytest.param(
        jev_body(
            questions={
                "b": {
                    "type": "noul",
                    "instructions": None,
                    "criteria": {"true": ["ads", "links"], "false": None},
                }
            }
        ),
        {"questions.b.criteria.true": '["ads", "links"]', "questions.b.criteria.false": None},
        id="noul-null-instructions-json-outcome",
    ),
    pytest.param(
        jev_body(
            questions={
                "tone": {
                    "type": "choice",
                    "criteria": {"calm": None, "angry": {"means": "hostile"}},
                }
            }
        ),
        {
            "questions.tone.instructions": None,
            "questions.tone.criteria.angry": '{"means": "hostile"}',
        },
        id="choice-without-instructions",
    ),
    pytest.param(
        jev_body(
            questions={
                "urgency": {
                    "type": "score",
                    "instructions": "How urgent?",
                    "criteria": ["Can wait", None, {"level": "today"}, None],
                }
            }
        ),
        {"questions.urgency.answers": ("Can wait", "level 1", '{"level": "today"}', "level 3")},
        id="score-null-and-json-levels",
    ),
    pytest.param(
        jev_body(questions={"c": choice(26), "s": score([f"L{i}" for i in range(10)])}),
        {"questions.c.answers": tuple(f"Option {i}" for i in range(26))},
        id="26-options-10-levels",
    ),
    pytest.param(
        jev_body(id="mine", samples=3, metadata={"t": 1}),
        {"id": "mine", "id_source": "request", "samples": 3},
        id="project-fields-and-own-id",
    ),
]


def _at(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[part] if isinstance(obj, dict) else getattr(obj, part)
    return obj


@pytest.mark.parametrize(("body", "reads"), JEV_GOOD)
def test_jev_body_is_accepted_unchanged(body: dict[str, Any], reads: dict[str, Any]) -> None:
    parsed = parse_request(enc(body), fallback_id=KEYED)
    assert isinstance(parsed, ClassificationRequest), parsed
    for path, value in reads.items():
        assert _at(parsed, path) == value, path
    if "id" not in body:
        assert parsed.id == "order-17" and parsed.id_source == "key"
    # What was read is a plain request: written in our own form, it reads back the same.
    again = parse_request(parsed.model_dump_json().encode())
    assert isinstance(again, ClassificationRequest)
    assert again.model_dump() == parsed.model_dump() and again.id_source == "request"


def test_state_renders_as_vllms_reader_and_the_limit_counts_its_text() -> None:
    state = {"msg": "naïve — ok", "list": [1, None, {"x": "y"}]}
    text = json.dumps(state, ensure_ascii=False)
    parsed = parse_request(enc(jev_body(state=state)), fallback_id=KEYED)
    assert isinstance(parsed, ClassificationRequest) and parsed.state == text
    exact = ParseLimits(max_state_chars=len(text))
    assert isinstance(
        parse_request(enc(jev_body(state=state)), exact, fallback_id=KEYED), ClassificationRequest
    )
    short = ParseLimits(max_state_chars=len(text) - 1)
    err = parse_request(enc(jev_body(state=state)), short, fallback_id=KEYED)
    assert isinstance(err, RequestError) and err.code is E.STATE_TOO_LARGE


def test_without_a_fallback_a_missing_id_is_still_refused() -> None:
    err = parse_request(enc(jev_body()))
    assert isinstance(err, RequestError)
    assert (err.code, err.field) == (E.MISSING_FIELD, "id")


@pytest.mark.parametrize(
    ("key", "expected"),
    [
        (b"order-17", FallbackId("order-17", "key")),
        ("名前-✓".encode(), FallbackId("名前-✓", "key")),
        (b"k" * 128, FallbackId("k" * 128, "key")),
        (None, FallbackId("in.jev-3-42", "record")),
        (b"", FallbackId("in.jev-3-42", "record")),
        (b"\xff\xfe", FallbackId("in.jev-3-42", "record")),
        (b"a\nb", FallbackId("in.jev-3-42", "record")),
        (b"k" * 129, FallbackId("in.jev-3-42", "record")),
        (b"\xed\xa0\x80", FallbackId("in.jev-3-42", "record")),  # a surrogate, not UTF-8
    ],
)
def test_record_id_takes_a_valid_key_else_topic_partition_offset(
    key: bytes | None, expected: FallbackId
) -> None:
    got = record_id(key, "in.jev", 3, 42)
    assert got == expected
    parsed = parse_request(enc(jev_body()), fallback_id=got)
    assert isinstance(parsed, ClassificationRequest)
    assert (parsed.id, parsed.id_source) == (expected.value, expected.source)


def test_record_id_of_a_long_topic_fits_and_stays_distinct() -> None:
    a, b = "t" * 240 + "a", "t" * 240 + "b"
    ida, idb = record_id(None, a, 11, 2**62), record_id(None, b, 11, 2**62)
    assert len(ida.value) <= 128 and ida.value.endswith(f"-11-{2**62}")
    assert ida != idb and record_id(None, a, 11, 2**62) == ida
    assert isinstance(parse_request(enc(jev_body()), fallback_id=ida), ClassificationRequest)


def test_a_dead_letter_of_a_body_without_id_takes_the_records_id() -> None:
    raw = enc(jev_body(questions={"b": {"type": "noul"}}))
    err = parse_request(raw, fallback_id=KEYED)
    assert isinstance(err, RequestError) and err.code is E.EMPTY_INSTRUCTIONS
    letter = DeadLetter.build(err, raw, "in", 0, 5, b"order-17", fallback_id=KEYED.value)
    assert letter.request_id == "order-17" and letter.original_bytes() == raw
    with_id = DeadLetter.build(err, enc(jev_body(id="own")), "in", 0, 6, fallback_id="x")
    assert with_id.request_id == "own"


def test_too_many_options_says_why_and_what_jev_takes() -> None:
    for n in (27, 255, 300):
        err = parse_request(enc(request({"topic": choice(n)})))
        assert isinstance(err, RequestError) and err.code is E.TOO_MANY_OPTIONS
        assert f"{n} options" in err.message and "26" in err.message and "255" in err.message


def test_null_levels_are_named_and_usable_in_ask_if() -> None:
    body = request(
        {
            "sev": score(["none", None, "bad"]),
            "why": yes_no(ask_if={"sev": ["level 1", "bad"]}),
        }
    )
    parsed = parse_request(enc(body))
    assert isinstance(parsed, ClassificationRequest) and parsed.questions is not None
    assert parsed.questions["sev"].answers == ("none", "level 1", "bad")
    bad = parse_request(
        enc(request({"sev": score([None, None]), "w": yes_no(ask_if={"sev": ["level 2"]})}))
    )
    assert isinstance(bad, RequestError) and bad.code is E.INVALID_ASK_IF_VALUE


# --- question order ---------------------------------------------------------------------------


def test_question_order_stages() -> None:
    body = request(
        {
            "a": yes_no(),
            "b": yes_no(depends_on=["a"]),
            "c": score(ask_if={"a": ["no"]}),
            "d": choice(2, depends_on=["b"], ask_if={"c": ["high", "medium"]}),
            "e": yes_no(),
            "f": yes_no(ask_if={"d": ["Option 1"]}, depends_on=["e"]),
            "g": yes_no(depends_on=["e"]),
        }
    )
    req = parse_request(enc(body))
    assert isinstance(req, ClassificationRequest)
    assert req.questions is not None
    expected = [["a", "e"], ["b", "c", "g"], ["d"], ["f"]]
    assert question_order(req.questions) == expected
    assert req.stages() == expected
    # independent questions form one stage, in request order
    flat = parse_request(enc(request({"z": yes_no(), "y": yes_no(), "x": yes_no()})))
    assert isinstance(flat, ClassificationRequest) and flat.questions is not None
    assert question_order(flat.questions) == [["z", "y", "x"]]
    by_name = parse_request(enc(request(DROP, question_set="s")))
    assert isinstance(by_name, ClassificationRequest) and by_name.stages() == []


def test_question_order_refuses_broken_graphs() -> None:
    a = YesNoQuestion(type="yes_no", instructions="a?", depends_on=["b"])
    b = YesNoQuestion(type="yes_no", instructions="b?", ask_if={"a": ["yes"]})
    with pytest.raises(RequestRejected) as info:
        question_order({"a": a, "b": b})
    assert info.value.code is ErrorCode.DEPENDENCY_CYCLE
    assert info.value.error.field == "questions.a.depends_on"
    assert "a -> b -> a" in info.value.error.message
    with pytest.raises(RequestRejected) as info:
        question_order({"a": a})
    assert info.value.code is ErrorCode.UNKNOWN_DEPENDENCY


# --- errors as values and as exceptions ---------------------------------------------------------


def test_request_rejected_carries_the_error_and_pickles() -> None:
    err = RequestError(
        code=ErrorCode.TEMPLATE_TOO_LONG, message="questions.q1: too long", field="questions.q1"
    )
    exc = RequestRejected(err)
    assert exc.error is err and exc.code is ErrorCode.TEMPLATE_TOO_LONG
    assert str(exc) == "TEMPLATE_TOO_LONG: questions.q1: too long"
    back = pickle.loads(pickle.dumps(exc))
    assert isinstance(back, RequestRejected) and back.error == err
    short = RequestRejected(ErrorCode.ENGINE_FAILED, "engine down")
    assert short.error == RequestError(code=ErrorCode.ENGINE_FAILED, message="engine down")
    with pytest.raises(TypeError):
        RequestRejected(err, "extra message")
    assert json.loads(err.model_dump_json()) == {
        "code": "TEMPLATE_TOO_LONG",
        "message": "questions.q1: too long",
        "field": "questions.q1",
    }


def test_request_id_hint() -> None:
    assert request_id_hint(enc(request(samples=0, id="abc"))) == "abc"
    assert request_id_hint(enc(request(state=5))) == "req-1"
    assert request_id_hint(b'{"id": "x", "state": ') is None
    assert request_id_hint(enc(request(id="x" * 129))) is None
    assert request_id_hint(enc(request(id="a\nb"))) is None
    assert request_id_hint(enc(request(id=5))) is None
    assert request_id_hint(b"[1]") is None
    assert request_id_hint(b"\xff") is None
    assert request_id_hint(None) is None
    assert request_id_hint(b"") is None


# --- dead letters ------------------------------------------------------------------------------


def test_dead_letter_round_trips_original_bytes() -> None:
    raw = b'\x00\xff{"id": "req-9", binary \xfe junk'
    err = parse_request(raw)
    assert isinstance(err, RequestError)
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone(timedelta(hours=2)))
    dl = DeadLetter.build(
        err, raw, "requests", 3, 1234, b"\x01key", 1_700_000_000_000, "w-1", time=when
    )
    assert dl.original_bytes() == raw
    assert base64.b64decode(dl.original) == raw
    assert dl.original_size == len(raw) and not dl.truncated
    assert dl.source.key_bytes() == b"\x01key"
    assert (dl.source.topic, dl.source.partition, dl.source.offset) == ("requests", 3, 1234)
    assert dl.source.timestamp_ms == 1_700_000_000_000
    assert dl.error.code is ErrorCode.INVALID_UTF8
    assert dl.request_id is None
    assert dl.time == when and dl.time.tzinfo is UTC
    text = dl.model_dump_json()
    assert '"time":"2026-01-02T01:04:05Z"' in text
    assert DeadLetter.model_validate_json(text) == dl


def test_dead_letter_recovers_id_and_handles_empty_and_large() -> None:
    body = enc(request(samples=99, id="req-42"))
    err = parse_request(body)
    assert isinstance(err, RequestError)
    dl = DeadLetter.build(err, body, "in", 0, 7, None, None, "w")
    assert dl.request_id == "req-42" and dl.source.key is None and dl.schema_version == 1
    assert dl.time.tzinfo is UTC
    assert dl.original_bytes() == body

    empty = parse_request(None)
    assert isinstance(empty, RequestError)
    for raw in (None, b""):
        dl = DeadLetter.build(empty, raw, "in", 0, 8, worker="w")
        assert dl.original == "" and dl.original_bytes() == b"" and dl.original_size == 0

    big = b"x" * 1000
    dl = DeadLetter.build(empty, big, "in", 0, 9, worker="w", max_original_bytes=100)
    assert dl.truncated and dl.original_size == 1000 and dl.original_bytes() == big[:100]


def test_dead_letter_refuses_bad_base64_and_naive_time_becomes_utc() -> None:
    err = RequestError(code=ErrorCode.INVALID_JSON, message="bad")
    base = {
        "error": err,
        "original": "!!!",
        "original_size": 3,
        "source": {"topic": "t", "partition": 0, "offset": 0},
        "worker": "w",
        "time": datetime(2026, 1, 1, 12, 0),
    }
    with pytest.raises(ValidationError):
        DeadLetter.model_validate(base)
    dl = DeadLetter.model_validate(base | {"original": base64.b64encode(b"abc").decode()})
    assert dl.time == datetime(2026, 1, 1, 12, 0, tzinfo=UTC)


# --- results -------------------------------------------------------------------------------------

YES_NO = {"type": "yes_no", "p_yes": 0.82, "label": "yes", "confidence": 0.82}
CHOICE = {
    "type": "choice",
    "choice": "Sports",
    "probabilities": {"Sports": 0.7, "Politics": 0.2, "Other": 0.1},
    "confidence": 0.7,
    "stderr": 0.03,
    "agreement": 0.75,
}
SCORE = {
    "type": "score",
    "expected_score": 2.4,
    "level": "medium",
    "legend": {"1": "low", "2": "medium", "3": "high"},
    "probabilities": {"low": 0.1, "medium": 0.4, "high": 0.5},
    "confidence": 0.5,
}
SKIPPED = {"type": "skipped", "reason": "ask_if not met: toxic=no"}


def result_body(**answers: Any) -> dict[str, Any]:
    return {
        "schema_version": 1,
        "id": "req-1",
        "status": "ok",
        "answers": answers,
        "diagnostics": {
            "reads": 4,
            "entropy": {"toxic": 0.47, "topic": 0.8},
            "label_mass": {"toxic": 0.93, "topic": None},
            "model": "google/diffusiongemma-26B-A4B-it",
            "engine": "transformers",
            "worker": "w-1",
            "timings": {"queue": 1.5, "engine": 20.25, "total": 23.0},
        },
        "metadata": {"trace": {"id": "ü"}},
    }


def test_result_models_validate_each_answer_type() -> None:
    body = result_body(toxic=YES_NO, topic=CHOICE, sev=SCORE, target=SKIPPED)
    res = ClassificationResult.model_validate_json(json.dumps(body))
    a = res.answers
    assert isinstance(a["toxic"], YesNoAnswer) and a["toxic"].stderr is None
    assert isinstance(a["topic"], ChoiceAnswer) and a["topic"].agreement == 0.75
    assert isinstance(a["sev"], ScoreAnswer) and a["sev"].legend["2"] == "medium"
    assert isinstance(a["target"], SkippedAnswer)
    dumped = json.loads(res.model_dump_json())
    # Uncalibrated answers say so: their raw_* fields are null.
    assert dumped["answers"]["topic"] == CHOICE | {"raw_probabilities": None}
    assert dumped["answers"]["toxic"] == YES_NO | {
        "stderr": None,
        "agreement": None,
        "raw_p_yes": None,
    }
    assert dumped["metadata"] == body["metadata"]
    assert ClassificationResult.model_validate(dumped) == res


def test_result_models_built_in_code() -> None:
    res = ClassificationResult(
        id="r",
        status="partial",
        answers={"x": YesNoAnswer(p_yes=0.1, label="no", confidence=0.9)},
        diagnostics=Diagnostics(
            reads=1, entropy={"x": 0.3}, label_mass={"x": 0.99}, model="m", engine="e", worker="w"
        ),
    )
    assert json.loads(res.model_dump_json())["answers"]["x"]["type"] == "yes_no"


@pytest.mark.parametrize(
    "answer",
    [
        YES_NO | {"p_yes": 1.2},
        YES_NO | {"label": "maybe"},
        YES_NO | {"extra": 1},
        CHOICE | {"choice": "Weather"},
        CHOICE | {"confidence": -0.1},
        CHOICE | {"agreement": 2},
        SCORE | {"legend": {"0": "low", "1": "medium", "2": "high"}},
        SCORE | {"level": "extreme"},
        SCORE | {"expected_score": 3.5},
        SCORE | {"probabilities": {"low": 0.5, "mid": 0.5, "high": 0.0}},
        {"type": "unknown", "reason": "x"},
        {"type": "skipped"},
    ],
)
def test_result_models_refuse_inconsistent_answers(answer: dict[str, Any]) -> None:
    with pytest.raises(ValidationError):
        ClassificationResult.model_validate(result_body(q=answer))


def test_result_refuses_non_finite_numbers() -> None:
    body = copy.deepcopy(result_body(toxic=YES_NO))
    body["diagnostics"]["entropy"]["toxic"] = float("nan")
    with pytest.raises(ValidationError):
        ClassificationResult.model_validate(body)

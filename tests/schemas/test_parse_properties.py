"""Property tests: `parse_request` answers ANY bytes with a request or a refusal, and every
refusal, with its original, makes a dead letter that can be written and read back.

Hostile input is normal in moderation: arbitrary bytes, any valid JSON (lone surrogates,
huge numbers, deep nesting, huge arrays), and valid requests with one field swapped for
something hostile.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgstream.schemas import (
    ClassificationRequest,
    ClassificationResult,
    DeadLetter,
    Diagnostics,
    ErrorCode,
    ParseLimits,
    RequestError,
    encode_output,
    parse_request,
    record_id,
)

pytestmark = pytest.mark.unit

# No example database (a test must not lean on what an earlier run left behind) and no
# per-example deadline (CI's two cores are slow and shared).
PROPERTY = settings(
    database=None,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

# Every code point, lone surrogates included (hypothesis leaves those out by default).
ANY_CHAR = st.characters(exclude_categories=())
ANY_TEXT = st.text(ANY_CHAR, max_size=40)
HUGE_NUMBERS = st.sampled_from(
    [10**4000, -(10**4299), 2**63, 2**64, -(2**63) - 1, 1e308, -1e308, 5e-324, -0.0, 10**30]
)
SCALARS = st.none() | st.booleans() | st.integers() | st.floats() | HUGE_NUMBERS | ANY_TEXT
JSON_VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(ANY_TEXT, inner, max_size=6),
    max_leaves=40,
)


def _deep(depth: int, leaf: Any, as_dict: bool, inside: str | None) -> bytes:
    """JSON text nested `depth` deep (built as text: Python's own encoder would recurse),
    at the top or inside one field of a good request."""
    opening, closing = ('{"k":', "}") if as_dict else ("[", "]")
    nested = opening * depth + json.dumps(leaf) + closing * depth
    if inside is None:
        return nested.encode()
    body = json.dumps({**GOOD_BODY, inside: "@@"})
    return body.replace('"@@"', nested).encode()


HUGE_ARRAYS = st.integers(0, 200_000).map(lambda n: [0] * n)
HOSTILE = JSON_VALUES | HUGE_ARRAYS | HUGE_NUMBERS

GOOD_BODY: dict[str, Any] = {
    "id": "evt-1",
    "state": "you idiot!!!",
    "questions": {
        "toxic": {"type": "noul", "instructions": "Does it insult someone?"},
        "topic": {
            "type": "choice",
            "instructions": "What is it about?",
            "criteria": {"sport": "games", "politics": None},
        },
        "sev": {"type": "score", "instructions": "How bad?", "criteria": ["none", "bad"]},
    },
    "metadata": {"trace": "abc"},
}
# Where a hostile value may be put in a good request (every field the schema reads).
PATHS: list[tuple[str | int, ...]] = [
    ("id",),
    ("state",),
    ("questions",),
    ("questions", "toxic"),
    ("questions", "toxic", "type"),
    ("questions", "toxic", "instructions"),
    ("questions", "toxic", "criteria"),
    ("questions", "toxic", "depends_on"),
    ("questions", "toxic", "ask_if"),
    ("questions", "topic", "criteria"),
    ("questions", "topic", "criteria", "sport"),
    ("questions", "sev", "criteria"),
    ("samples",),
    ("auto_threshold",),
    ("reply_topic",),
    ("question_set",),
    ("metadata",),
    ("metadata", "trace"),
    ("schema_version",),
    ("model",),
    ("questions", "sev", "criteria", 0),
    ("questions", "sev", "instructions"),
]

# A body as Jev's clients send it (no id, a model, JSON state, null criteria), read with
# the record's id as the fallback.
JEV_BODY: dict[str, Any] = {
    "state": {"message": "you idiot!!!", "thread": [1, 2]},
    "model": "jev-latest",
    "questions": {
        "toxic": {"type": "noul", "criteria": {"true": "insults", "false": None}},
        "tone": {"type": "choice", "criteria": {"calm": None, "angry": {"means": "hostile"}}},
        "sev": {"type": "score", "instructions": None, "criteria": ["none", None, "bad"]},
    },
}
JEV_PATHS: list[tuple[str | int, ...]] = [
    ("state",),
    ("state", "message"),
    ("model",),
    ("questions", "toxic", "instructions"),
    ("questions", "toxic", "criteria"),
    ("questions", "toxic", "criteria", "true"),
    ("questions", "tone", "criteria", "angry"),
    ("questions", "tone", "instructions"),
    ("questions", "sev", "criteria"),
    ("questions", "sev", "criteria", 1),
    ("id",),
]

LIMITS = ParseLimits(max_message_bytes=4 << 20)


def _encodings(doc: Any) -> list[bytes]:
    """The document as JSON a producer might send: ASCII escapes (lone surrogates become
    `\\udXXX`), raw UTF-8 (a lone surrogate becomes invalid UTF-8), and with NaN tokens."""
    out = [json.dumps(doc, ensure_ascii=True).encode()]
    out.append(json.dumps(doc, ensure_ascii=False).encode("utf-8", "surrogatepass"))
    return out


def _check_outcome(raw: bytes, outcome: object) -> None:
    assert isinstance(outcome, ClassificationRequest | RequestError), type(outcome)
    if isinstance(outcome, RequestError):
        # The refusal is machine-readable and writable, and so is its dead letter.
        assert isinstance(outcome.code, ErrorCode)
        assert outcome.message
        outcome.model_dump_json().encode()
        letter = DeadLetter.build(outcome, raw, "in", 0, 7, key=b"\xff\x00", worker="w")
        back = DeadLetter.model_validate_json(letter.model_dump_json().encode())
        assert back.original_bytes() == raw
        assert back.error == outcome
        return
    # An accepted request is text all the way down: its fields encode, and a result that
    # echoes its metadata can be written.
    outcome.model_dump_json().encode()
    outcome.state.encode()
    result = ClassificationResult(
        id=outcome.id,
        status="ok",
        answers={},
        diagnostics=Diagnostics(
            reads=0, entropy={}, label_mass={}, model="m", engine="fake", worker="w"
        ),
        metadata=outcome.metadata,
        requested_model=outcome.model,
        id_source=outcome.id_source,
    )
    json.loads(result.model_dump_json().encode())
    json.loads(encode_output(result, "jev"))


def _put(body: Any, path: tuple[str | int, ...], value: Any) -> Any:
    body = json.loads(json.dumps(body))
    node = body
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return body


@PROPERTY
@given(st.binary(max_size=2048))
def test_any_bytes(raw: bytes) -> None:
    _check_outcome(raw, parse_request(raw, LIMITS))


@PROPERTY
@given(HOSTILE)
def test_any_json_document(doc: Any) -> None:
    for raw in _encodings(doc):
        _check_outcome(raw, parse_request(raw, LIMITS))


@PROPERTY
@given(
    st.integers(0, 20_000),
    SCALARS,
    st.booleans(),
    st.sampled_from([None, "state", "metadata", "questions", "samples"]),
)
def test_deep_nesting(depth: int, leaf: Any, as_dict: bool, inside: str | None) -> None:
    raw = _deep(depth, leaf, as_dict, inside)
    _check_outcome(raw, parse_request(raw, LIMITS))


@PROPERTY
@given(st.sampled_from(PATHS), HOSTILE)
def test_good_request_with_one_hostile_field(path: tuple[str | int, ...], value: Any) -> None:
    for raw in _encodings(_put(GOOD_BODY, path, value)):
        _check_outcome(raw, parse_request(raw, LIMITS))


@PROPERTY
@given(st.sampled_from(JEV_PATHS), HOSTILE, st.none() | st.binary(max_size=200))
def test_jev_body_with_one_hostile_field(
    path: tuple[str | int, ...], value: Any, key: bytes | None
) -> None:
    fallback = record_id(key, "jev.requests", 2, 99)
    for raw in _encodings(_put(JEV_BODY, path, value)):
        _check_outcome(raw, parse_request(raw, LIMITS, fallback_id=fallback))


@PROPERTY
@given(st.none() | st.binary(max_size=300), st.text(min_size=1, max_size=249), st.integers(0))
def test_any_record_gives_a_usable_id(key: bytes | None, topic: str, offset: int) -> None:
    """Whatever the key (and however long the topic), a Jev body gets an id it accepts."""
    fallback = record_id(key, topic, 7, offset)
    parsed = parse_request(json.dumps(JEV_BODY).encode(), LIMITS, fallback_id=fallback)
    assert isinstance(parsed, ClassificationRequest), parsed
    assert (parsed.id, parsed.id_source) == (fallback.value, fallback.source)
    assert fallback.source == "key" or fallback.value.endswith(f"-7-{offset}")


# Objects of a good request whose keys a producer chooses (or may misspell).
KEYED: list[tuple[str, tuple[str, ...]]] = [
    ("ours", ()),
    ("ours", ("questions",)),
    ("ours", ("questions", "toxic")),
    ("ours", ("questions", "topic", "criteria")),
    ("ours", ("metadata",)),
    ("jev", ()),
    ("jev", ("state",)),
    ("jev", ("questions", "toxic", "criteria")),
    ("jev", ("questions", "tone", "criteria", "angry")),
]


@PROPERTY
@given(st.sampled_from(KEYED), ANY_TEXT, st.booleans())
def test_hostile_key_anywhere(where: tuple[str, tuple[str, ...]], key: str, rename: bool) -> None:
    """A hostile text as a key: a question id, an option name, a metadata key, a key inside
    a JSON state or description, ..."""
    which, path = where
    body = json.loads(json.dumps(GOOD_BODY if which == "ours" else JEV_BODY))
    node = body
    for k in path:
        node = node[k]
    first = next(iter(node))
    node[key] = node.pop(first) if rename else node[first]
    fallback = None if which == "ours" else record_id(b"k", "t", 0, 1)
    for raw in _encodings(body):
        _check_outcome(raw, parse_request(raw, LIMITS, fallback_id=fallback))


SURROGATE_FIELDS = [
    ("id",),
    ("state",),
    ("questions", "toxic", "instructions"),
    ("questions", "topic", "criteria", "sport"),
    ("questions", "sev", "criteria", 1),
    ("metadata", "trace"),
    ("reply_topic",),
    ("model",),
]


@pytest.mark.parametrize("path", SURROGATE_FIELDS, ids=lambda p: ".".join(map(str, p)))
@pytest.mark.parametrize("char", ["\ud800", "\udfff", "a\udc00b"])
def test_lone_surrogate_is_refused_naming_the_field(path: tuple[str | int, ...], char: str) -> None:
    raw = json.dumps(_put(GOOD_BODY, path, char)).encode()
    err = parse_request(raw)
    assert isinstance(err, RequestError)
    assert err.code is ErrorCode.INVALID_UNICODE
    assert err.field == ".".join(map(str, path))
    assert err.field in err.message


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (
            {**GOOD_BODY, "questions": {"\ud800": {"type": "noul", "instructions": "q"}}},
            "questions.\\ud800",
        ),
        (_put(GOOD_BODY, ("questions", "topic", "criteria"), {"\udc00": None, "b": None}), None),
        ({**GOOD_BODY, "metadata": {"\udbff": 1}}, "metadata.\\udbff"),
        ({**GOOD_BODY, "metadata": {"a": [1, ["\ud800"]]}}, "metadata.a.1.0"),
    ],
    ids=["question-id", "option-name", "metadata-key", "in-a-list"],
)
def test_lone_surrogate_in_a_key_or_list(body: dict[str, Any], field: str | None) -> None:
    err = parse_request(json.dumps(body).encode())
    assert isinstance(err, RequestError)
    assert err.code is ErrorCode.INVALID_UNICODE
    if field is not None:
        assert err.field == field
    assert "\\ud" in err.message  # the key is quoted escaped, never as a raw surrogate
    err.model_dump_json().encode()


def test_a_surrogate_pair_is_text_and_is_accepted() -> None:
    raw = json.dumps({**GOOD_BODY, "state": "\U0001f600 ok"}).encode()
    assert "\\ud83d\\ude00" in raw.decode()
    parsed = parse_request(raw)
    assert isinstance(parsed, ClassificationRequest)
    assert parsed.state == "\U0001f600 ok"


def test_escaped_backslash_u_is_not_a_surrogate() -> None:
    raw = json.dumps({**GOOD_BODY, "state": "\\ud800 is how JSON writes it"}).encode()
    parsed = parse_request(raw)
    assert isinstance(parsed, ClassificationRequest)


# --- the dead letter's id hint on long values ---------------------------------------------------

_PAD = "\u0000pad"  # a key no generated document uses for anything that matters to the hint
IDS = st.none() | st.sampled_from(["req-1", "evt 9", "x" * 128, "x" * 129, "a\nb", ""]) | ANY_TEXT


@PROPERTY
@given(
    st.dictionaries(ANY_TEXT, HOSTILE, max_size=4),
    IDS,
    st.none() | st.dictionaries(ANY_TEXT, HOSTILE, max_size=3),
    IDS,
    st.booleans(),
    st.booleans(),
)
def test_a_long_message_gives_the_id_hint_a_short_one_gives(
    body: dict[str, Any],
    ident: str | None,
    data: dict[str, Any] | None,
    data_id: str | None,
    event: bool,
    pad_first: bool,
) -> None:
    """Past HINT_LOAD_BYTES the hint is scanned, not parsed; it must say what parsing says
    (the request's id; an event's data.id, else its id), wherever the padding lies."""
    from dgstream.schemas import request_id_hint
    from dgstream.schemas.parse import HINT_LOAD_BYTES

    doc = {k: v for k, v in body.items() if k != _PAD}
    if ident is not None:
        doc["id"] = ident
    if event:
        doc["specversion"] = "1.0"
    if data is not None:
        doc["data"] = {**data, **({} if data_id is None else {"id": data_id})}
    pad = {_PAD: "p" * HINT_LOAD_BYTES}
    long = {**pad, **doc} if pad_first else {**doc, **pad}
    short_hint = request_id_hint(json.dumps(doc).encode())
    raw = json.dumps(long).encode()
    assert len(raw) > HINT_LOAD_BYTES
    assert request_id_hint(raw) == short_hint
    # Cut short (as the consumer's CutValue and a truncated dead letter are), it is read
    # as far as the bytes go: here, every member but the last byte.
    assert request_id_hint(raw[:-1]) == short_hint

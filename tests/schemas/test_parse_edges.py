"""Every limit at its exact edge: the largest value allowed parses, one more is refused with
its code, the field it names and a message that says both numbers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from dgstream.schemas import (
    ClassificationRequest,
    ErrorCode,
    ParseLimits,
    RequestError,
    parse_request,
    record_id,
)
from dgstream.schemas.parse import surrogate_path

pytestmark = pytest.mark.unit

YES_NO = {"type": "noul", "instructions": "Is it rude?"}


def _body(**fields: Any) -> dict[str, Any]:
    return {"id": "r", "state": "some text", "questions": {"rude": YES_NO}, **fields}


def _raw(body: dict[str, Any]) -> bytes:
    return json.dumps(body).encode()


def _refused(raw: bytes, limits: ParseLimits | None = None) -> RequestError:
    got = parse_request(raw, limits) if limits else parse_request(raw)
    assert isinstance(got, RequestError), got
    return got


def _accepted(raw: bytes, limits: ParseLimits | None = None) -> ClassificationRequest:
    got = parse_request(raw, limits) if limits else parse_request(raw)
    assert isinstance(got, ClassificationRequest), got
    return got


def test_a_message_of_exactly_the_size_limit_parses_and_one_byte_more_does_not() -> None:
    raw = _raw(_body())
    _accepted(raw, ParseLimits(max_message_bytes=len(raw)))
    err = _refused(raw, ParseLimits(max_message_bytes=len(raw) - 1))
    assert (err.code, err.field) == (ErrorCode.MESSAGE_TOO_LARGE, None)
    assert err.message == f"the message has {len(raw)} bytes; the limit is {len(raw) - 1}"


def test_the_size_limit_counts_bytes_not_characters() -> None:
    raw = _raw(_body(state="é" * 10)).replace(b"\\u00e9", "é".encode())  # 2 bytes each
    assert len(raw) == len(raw.decode()) + 10
    _accepted(raw, ParseLimits(max_message_bytes=len(raw)))
    assert _refused(raw, ParseLimits(max_message_bytes=len(raw) - 1)).code == (
        ErrorCode.MESSAGE_TOO_LARGE
    )


def test_a_state_of_exactly_the_limit_parses_and_one_character_more_does_not() -> None:
    limits = ParseLimits(max_state_chars=20)
    assert _accepted(_raw(_body(state="x" * 20)), limits).state == "x" * 20
    err = _refused(_raw(_body(state="x" * 21)), limits)
    assert (err.code, err.field) == (ErrorCode.STATE_TOO_LARGE, "state")
    assert err.message == "state: state has 21 characters; the limit is 20"


def test_exactly_the_most_questions_parse_and_one_more_does_not() -> None:
    limits = ParseLimits(max_questions=3)
    three = {f"q{i}": YES_NO for i in range(3)}
    assert len(_accepted(_raw(_body(questions=three)), limits).questions or {}) == 3
    err = _refused(_raw(_body(questions={**three, "q3": YES_NO})), limits)
    assert (err.code, err.field) == (ErrorCode.TOO_MANY_QUESTIONS, "questions")
    assert err.message == "questions: 4 questions; at most 3 are allowed"


@pytest.mark.parametrize(
    ("field", "ok", "bad", "code"),
    [
        ("id", "i" * 128, "i" * 129, ErrorCode.ID_TOO_LONG),
        ("samples", 16, 17, ErrorCode.INVALID_SAMPLES),
        ("samples", 1, 0, ErrorCode.INVALID_SAMPLES),
    ],
)
def test_request_fields_at_their_edges(field: str, ok: Any, bad: Any, code: ErrorCode) -> None:
    _accepted(_raw(_body(**{field: ok})))
    err = _refused(_raw(_body(**{field: bad})))
    assert (err.code, err.field) == (code, field)


@pytest.mark.parametrize(("ok", "bad"), [(2, 1), (16, 17)])
def test_auto_max_at_its_edges(ok: int, bad: int) -> None:
    assert _accepted(_raw(_body(samples="auto", auto_max=ok))).auto_max == ok
    err = _refused(_raw(_body(samples="auto", auto_max=bad)))
    assert (err.code, err.field) == (ErrorCode.INVALID_AUTO_OPTIONS, "auto_max")


@pytest.mark.parametrize(
    ("kind", "ok", "too_many", "too_few", "codes"),
    [
        ("choice", 26, 27, 1, (ErrorCode.TOO_MANY_OPTIONS, ErrorCode.TOO_FEW_OPTIONS)),
        ("score", 10, 11, 1, (ErrorCode.TOO_MANY_LEVELS, ErrorCode.TOO_FEW_LEVELS)),
    ],
)
def test_options_and_levels_at_their_edges(
    kind: str, ok: int, too_many: int, too_few: int, codes: tuple[ErrorCode, ErrorCode]
) -> None:
    def question(n: int) -> dict[str, Any]:
        names = [f"name {i}" for i in range(n)]
        criteria: Any = dict.fromkeys(names) if kind == "choice" else names
        return {"type": kind, "instructions": "Which?", "criteria": criteria}

    _accepted(_raw(_body(questions={"q": question(ok)})))
    _accepted(_raw(_body(questions={"q": question(2)})))
    for n, code in zip((too_many, too_few), codes, strict=True):
        err = _refused(_raw(_body(questions={"q": question(n)})))
        assert (err.code, err.field) == (code, "questions.q.criteria")


# --------------------------------------------------------------------------- messages
# What the parser itself says (not pydantic's own wording): each refusal names its field
# in the message and says what was wrong.

_Q = '"questions": {"q": {"type": "noul", "instructions": "x"}}'


@pytest.mark.parametrize(
    ("raw", "code", "field", "message"),
    [
        (b"", ErrorCode.EMPTY_MESSAGE, None, "the message is empty"),
        (None, ErrorCode.EMPTY_MESSAGE, None, "the message is empty"),
        (b'{"id": "r\xff"}', ErrorCode.INVALID_UTF8, None, "the message is not UTF-8 (byte 9)"),
        (
            b'{"id": "r1", "state": ',
            ErrorCode.INVALID_JSON,
            None,
            "the message is not JSON: Expecting value (line 1, column 23)",
        ),
        (
            b'{"id": "r", "v": NaN}',
            ErrorCode.INVALID_JSON,
            None,
            "the message is not valid JSON: NaN is not allowed",
        ),
        (
            b'{"id": "r", "v": 1e400}',
            ErrorCode.INVALID_JSON,
            None,
            "the message is not valid JSON: number 1e400 is out of range",
        ),
        (
            b'{"id": "a", "id": "b"}',
            ErrorCode.INVALID_JSON,
            None,
            "the message is not valid JSON: duplicate key 'id'",
        ),
        (
            b"[" * 100_000 + b"]" * 100_000,
            ErrorCode.INVALID_JSON,
            None,
            "the message is not valid JSON: nested too deeply",
        ),
        (b"[1, 2]", ErrorCode.NOT_AN_OBJECT, None, "the message is a JSON array, not an object"),
        (b'"text"', ErrorCode.NOT_AN_OBJECT, None, "the message is a JSON string, not an object"),
        (
            b'{"schema_version": 2, "id": "r"}',
            ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
            "schema_version",
            "schema_version: version 2 is not supported (this worker reads 1)",
        ),
        (
            b'{"schema_version": true, "id": "r"}',
            ErrorCode.UNSUPPORTED_SCHEMA_VERSION,
            "schema_version",
            "schema_version: version True is not supported (this worker reads 1)",
        ),
        (
            b'{"id": "r", ' + _Q.encode() + b"}",
            ErrorCode.MISSING_FIELD,
            "state",
            "state: required field is missing",
        ),
        (
            b'{"id": "r", "state": "x", ' + _Q.encode() + b', "extra": 1}',
            ErrorCode.UNKNOWN_FIELD,
            "extra",
            "extra: unknown field",
        ),
        (
            b'{"id": "r", "state": "x", "questions": {"q": {"type": "bogus"}}}',
            ErrorCode.UNKNOWN_QUESTION_KIND,
            "questions.q.type",
            "questions.q.type: unknown question type 'bogus'; expected one of noul, yes_no, "
            "choice, score",
        ),
        (
            b'{"id": "r", "state": "x", "questions": {"q": {"instructions": "x"}}}',
            ErrorCode.MISSING_FIELD,
            "questions.q.type",
            "questions.q.type: required field is missing",
        ),
    ],
)
def test_the_parsers_own_messages(
    raw: bytes | None, code: ErrorCode, field: str | None, message: str
) -> None:
    err = _refused(raw)  # type: ignore[arg-type]
    assert (err.code, err.field, err.message) == (code, field, message)


SURROGATE = (
    "a string holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), which "
    "is no Unicode text"
)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (
            b'{"id": "r", "state": "x", "questions": {"q": {"type": "noul", '
            b'"instructions": "\\ud800"}}}',
            "questions.q.instructions",
        ),
        (b'{"id": "r", "metadata": {"a": ["ok", "\\udc00", "fine"]}}', "metadata.a.1"),
        (b'{"id": "r", "metadata": {"\\udc00": 1}}', "metadata.\\udc00"),
        (b'["\\udc00"]', None),  # not an object: refused before the surrogate check
    ],
)
def test_a_lone_surrogate_is_named_by_its_path(raw: bytes, field: str | None) -> None:
    err = _refused(raw)
    if field is None:
        assert err.code == ErrorCode.NOT_AN_OBJECT
        return
    assert (err.code, err.field) == (ErrorCode.INVALID_UNICODE, field)
    assert err.message == f"{field}: {SURROGATE}"


def test_pydantics_refusals_keep_the_field_and_say_what_came() -> None:
    err = _refused(b'{"id": "r", "state": 5, ' + _Q.encode() + b"}")
    assert (err.code, err.field) == (ErrorCode.WRONG_TYPE, "state")
    assert err.message.startswith("state: ") and err.message.endswith(", got number")
    err = _refused(b'{"id": "r", "state": "x", ' + _Q.encode() + b', "metadata": 5}')
    assert (err.code, err.field) == (ErrorCode.INVALID_METADATA, "metadata")
    assert err.message.startswith("metadata: ")


def test_surrogate_paths_of_any_json_value() -> None:
    assert surrogate_path("\udc00") == ""
    assert surrogate_path(["ok", "\udc00", "fine"]) == "1"
    assert surrogate_path([["ok", ["\ud800"]]]) == "0.1.0"
    assert surrogate_path({"a": [{"b": "\ud800"}]}) == "a.0.b"
    assert surrogate_path({"a": "ok", "b": ["x"]}) is None


# --------------------------------------------------------------------------- record ids


def test_a_one_character_key_is_an_id() -> None:
    assert record_id(b"k", "in", 0, 1) == ("k", "key")


@pytest.mark.parametrize("extra", [0, 1])
def test_a_topic_is_kept_whole_while_the_id_fits(extra: int) -> None:
    """'<topic>-0-5' of exactly 128 characters keeps the topic; one more and the topic is cut
    and followed by '~' and 12 hex digits of its hash, still 128 characters."""
    topic = "t" * (124 + extra)
    got = record_id(None, topic, 0, 5)
    assert got.source == "record" and len(got.value) == 128
    if not extra:
        assert got.value == f"{topic}-0-5"
        return
    keep, _, rest = got.value.partition("~")
    assert keep == "t" * (128 - len("-0-5") - 12 - 1)
    digest, _, where = rest.partition("-")
    assert len(digest) == 12 and int(digest, 16) >= 0 and where == "0-5"


def test_a_topic_outside_kafkas_characters_is_replaced_and_hashed() -> None:
    got = record_id(None, "a b/c", 2, 9)
    keep, _, rest = got.value.partition("~")
    assert keep == "a_b_c" and rest.endswith("-2-9") and len(rest) == 12 + len("-2-9")
    assert record_id(None, "a_b_c", 2, 9).value == "a_b_c-2-9"  # a valid name stays
    # A lone surrogate (no Kafka topic has one) still gives an id, not an exception.
    odd = record_id(None, "t\ud800", 2, 9)
    assert odd.value.startswith("t_~") and odd.value.endswith("-2-9")
    assert odd != record_id(None, "t\udc00", 2, 9)  # the hash keeps them apart


# --------------------------------------------------------------------------- dependency graphs


def _graph(deps: dict[str, list[str]]) -> RequestError | ClassificationRequest:
    questions = {q: {**YES_NO, "depends_on": d} for q, d in deps.items()}
    return parse_request(_raw(_body(questions=questions)))


@pytest.mark.parametrize(
    ("deps", "cycle", "field"),
    [
        # Found from the first question in request order, after a finished branch (x).
        ({"a": ["x", "c"], "x": [], "c": ["a"]}, "a -> c -> a", "questions.a.depends_on"),
        # x is done before a's turn: passing it over must not end a's search.
        ({"x": [], "a": ["x", "c"], "c": ["a"]}, "a -> c -> a", "questions.a.depends_on"),
        # A question done from an earlier root is passed over; the search goes on to c, d.
        ({"a": ["b"], "b": [], "c": ["d"], "d": ["c"]}, "c -> d -> c", "questions.c.depends_on"),
        # A cycle that does not pass through where the search started.
        ({"a": ["b"], "b": ["c"], "c": ["b"]}, "b -> c -> b", "questions.b.depends_on"),
    ],
)
def test_dependency_cycles_are_found(deps: dict[str, list[str]], cycle: str, field: str) -> None:
    err = _graph(deps)
    assert isinstance(err, RequestError), err
    assert (err.code, err.field) == (ErrorCode.DEPENDENCY_CYCLE, field)
    assert err.message == f"{field}: dependency cycle {cycle}"


@pytest.mark.parametrize(
    "deps",
    [
        {"d": [], "b": ["d"], "c": ["d"], "a": ["b", "c"]},
        # The top first: one search reaches d twice, through b and then through c.
        {"a": ["b", "c"], "b": ["d"], "c": ["d"], "d": []},
    ],
    ids=["bottom-first", "top-first"],
)
def test_a_diamond_is_no_cycle(deps: dict[str, list[str]]) -> None:
    got = _graph(deps)
    assert isinstance(got, ClassificationRequest), got
    assert got.stages() == [["d"], ["b", "c"], ["a"]]


def test_a_ladder_of_the_most_questions_is_ordered_in_as_many_stages() -> None:
    """64 questions, each waiting for the two before it: 2^n paths, each question visited
    once."""
    deps = {f"q{i}": [f"q{j}" for j in (i - 1, i - 2) if j >= 0] for i in range(64)}
    got = _graph(deps)
    assert isinstance(got, ClassificationRequest), got
    assert got.stages() == [[f"q{i}"] for i in range(64)]


@pytest.mark.parametrize(
    ("questions", "field", "message"),
    [
        (
            {"spam": YES_NO, "t": {**YES_NO, "ask_if": {"spam": []}}},
            "questions.t.ask_if.spam",
            "lists no answers",
        ),
        (
            {"spam": YES_NO, "t": {**YES_NO, "ask_if": {"spam": ["maybe"]}}},
            "questions.t.ask_if.spam",
            "'maybe' is not an answer of 'spam'; its answers are 'yes', 'no'",
        ),
        # The cycle's first edge is an ask_if: the field names that, not depends_on.
        (
            {"a": {**YES_NO, "ask_if": {"b": ["yes"]}}, "b": {**YES_NO, "depends_on": ["a"]}},
            "questions.a.ask_if",
            "dependency cycle a -> b -> a",
        ),
    ],
)
def test_ask_if_refusals_say_what_is_wrong(
    questions: dict[str, Any], field: str, message: str
) -> None:
    err = _refused(_raw(_body(questions=questions)))
    assert (err.field, err.message) == (field, f"{field}: {message}")


class _Unreadable:
    """A value whose length cannot be taken: the parser's own failure, not the message's."""

    def __len__(self) -> int:
        raise RuntimeError("x" * 600)


def test_a_failure_inside_the_parser_refuses_the_record_and_says_what_broke() -> None:
    err = _refused(12345)  # type: ignore[arg-type]
    assert (err.code, err.field) == (ErrorCode.INVALID_VALUE, None)
    assert err.message == (
        "the message could not be read (TypeError: object of type 'int' has no len())"
    )
    # A long reason is cut to 500 characters.
    long = _refused(_Unreadable())  # type: ignore[arg-type]
    head = "the message could not be read (RuntimeError: "
    assert long.message == (head + "x" * 600)[:500]
    assert (long.code, len(long.message)) == (ErrorCode.INVALID_VALUE, 500)


def test_text_holding_a_lone_surrogate_is_refused_as_bytes_would_be() -> None:
    """A str (a caller that decoded the record itself) with a lone surrogate: encoded with
    surrogatepass, it fails the UTF-8 check like the raw bytes, instead of raising."""
    err = _refused('{"id": "\ud800", "state": "x"}')  # type: ignore[arg-type]
    assert err.code == ErrorCode.INVALID_UTF8
    assert err.message == "the message is not UTF-8 (byte 8)"


def test_a_request_too_deep_for_the_validator_is_refused_not_raised(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """JSON the decoder took can still exhaust the validator's recursion (its own limit
    differs from the decoder's); the record is refused, and the worker goes on."""

    def too_deep(*args: Any, **kwargs: Any) -> Any:
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(ClassificationRequest, "model_validate", too_deep)
    err = _refused(_raw(_body()))
    assert (err.code, err.field) == (ErrorCode.INVALID_VALUE, None)
    assert err.message == "the request is nested too deeply"


@pytest.mark.parametrize(
    ("loc", "field"),
    [((), "instructions"), (("questions", "rude", "yes_no"), "questions.rude.instructions")],
    ids=["top-level", "nested"],
)
def test_a_refusal_that_names_a_field_below_its_model_keeps_the_path(
    loc: tuple[str, ...], field: str
) -> None:
    """A model-level check (a yes/no question without instructions) names the field it
    wants; that goes below the model's own path, or alone at the top."""
    from dgstream.schemas._common import SUFFIX_CTX
    from dgstream.schemas.parse import _classify

    code, _, path = _classify(
        {
            "type": ErrorCode.EMPTY_INSTRUCTIONS.value,
            "loc": loc,
            "msg": "needs instructions",
            "input": None,
            "ctx": {SUFFIX_CTX: "instructions"},
        }
    )
    assert (code, path) == (ErrorCode.EMPTY_INSTRUCTIONS, field)


# --- the id hint of a long message: scanned, never parsed whole --------------------------------

_LONG = "s" * (70 * 1024)  # past HINT_LOAD_BYTES (64 KiB)


@pytest.mark.parametrize(
    ("raw", "hint"),
    [
        (_raw({"id": "first", "state": _LONG}), "first"),
        (_raw({"state": _LONG, "metadata": {"id": "inner"}, "id": "last"}), "last"),
        (b'{"id": "one", "s": "' + _LONG.encode() + b'", "id": "two"}', "two"),
        (b'{"\\u0069d": "escaped", "s": "' + _LONG.encode() + b'"}', "escaped"),
        (_raw({"specversion": "1.0", "id": "evt", "data": {"s": _LONG, "id": "req"}}), "req"),
        (_raw({"specversion": "1.0", "id": "evt", "data": {"s": _LONG}}), "evt"),
        (_raw({"id": "evt", "data": {"s": _LONG, "id": "req"}}), "evt"),
        (_raw({"id": 7, "state": _LONG}), None),
        (_raw({"id": "x" * 129, "state": _LONG}), None),
        (_raw({"state": _LONG}), None),
        (_raw({"id": "ok", "state": _LONG})[:-1], "ok"),
        (_raw({"id": "ok", "state": _LONG}) + b" x", "ok"),
        (_raw({"state": _LONG, "id": "cut"})[:-3], None),
        (_raw([{"id": "in-a-list"}, _LONG]), None),
        (b'{"id": "ok", "s": "' + _LONG.encode(), "ok"),
        (b'{"s": "' + _LONG.encode() + b'", "id": "read"', "read"),
        (b'{"id": "ok" "s": 1, "pad": "' + _LONG.encode() + b'"}', "ok"),
        (b'{"pad": "' + _LONG.encode() + b'" "id": "after"}', None),
        (b'{"id": "\\q", "pad": "' + _LONG.encode() + b'"}', None),
    ],
    ids=[
        "first",
        "after-a-nested-id",
        "repeated-the-last",
        "escaped-key",
        "event-data-id",
        "event-id",
        "data-without-specversion",
        "not-a-string",
        "too-long",
        "none",
        "cut-after-the-id",
        "trailing-junk",
        "cut-inside-the-id",
        "not-an-object",
        "unclosed-string-after-the-id",
        "unclosed-object",
        "no-comma-after-the-id",
        "no-comma-before-the-id",
        "bad-escape",
    ],
)
def test_a_long_message_is_scanned_for_its_id(raw: bytes, hint: str | None) -> None:
    from dgstream.schemas import request_id_hint
    from dgstream.schemas.parse import HINT_LOAD_BYTES

    assert len(raw) > HINT_LOAD_BYTES
    assert request_id_hint(raw) == hint


@pytest.mark.parametrize(
    "raw",
    [
        b'{"id": "b", "m": [' + b"[]," * 600_000 + b"[]]}",
        b'{"m": [' + b"[]," * 600_000 + b'[]], "id": "b"}',
        b"[" + b"[]," * 600_000 + b"[]]",
        b'{"id": "b", "s": "' + b"\\u00e9" * 300_000 + b'"}',
    ],
    ids=["bomb-after-the-id", "bomb-before-the-id", "bomb", "escapes"],
)
def test_the_id_hint_of_a_bomb_allocates_next_to_nothing(raw: bytes) -> None:
    """Parsed whole, 1.8 MB of `[]` would be some 70 MB of Python lists; the scan builds
    none of them (a bomb before the id exhausts its budget: no hint; after it, the id
    has been read)."""
    import tracemalloc

    from dgstream.schemas import request_id_hint

    tracemalloc.start()
    try:
        hint = request_id_hint(raw)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak
    assert hint == (None if raw.startswith((b"[", b'{"m"')) else "b")

"""Every limit at its exact edge: the largest value allowed parses, one more is refused with
its code, the field it names and a message that says both numbers."""

from __future__ import annotations

import json
from typing import Any

import pytest

from schemas import ClassificationRequest, ErrorCode, ParseLimits, RequestError, parse_request

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

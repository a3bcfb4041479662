"""Dead letters in both formats without a broker: the JSON document keeps the original
record (value, key, headers, a tombstone's missing value) byte for byte; the raw format
(Kafka Connect's convention: the original as the record, the error in headers) reads back
to the same letter, even when the original's own headers look like ours."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from schemas import DeadLetter, ErrorCode, RequestError
from schemas.dead_letter import RAW_FORMAT

pytestmark = pytest.mark.unit

ERR = RequestError(code=ErrorCode.INVALID_JSON, message="not JSON at byte 3", field=None)
HEADERS: list[tuple[str, bytes | None]] = [
    ("trace", b"\x00\xffabc"),
    ("error_code", b"the producer's own header"),  # looks like ours: it is the original's
    ("empty", None),
    ("trace", b"second value, same key"),
]
WHEN = datetime(2026, 12, 1, 10, 0, tzinfo=UTC)


def _letter(value: bytes | None, **kw: object) -> DeadLetter:
    return DeadLetter.build(
        ERR,
        value,
        "requests",
        2,
        41,
        b"\x01key",
        1_796_000_000_000,
        "w-0",
        headers=HEADERS,
        time=WHEN,
        **kw,  # type: ignore[arg-type]
    )


def test_the_json_document_keeps_the_whole_record() -> None:
    letter = _letter(b"{not json \xff")
    back = DeadLetter.from_record(letter.model_dump_json().encode(), b"ignored", [])
    assert back == letter
    assert back.original_value() == b"{not json \xff"
    assert back.source.key_bytes() == b"\x01key"
    assert back.original_headers() == HEADERS
    assert not back.truncated


def test_a_tombstone_is_not_an_empty_value() -> None:
    assert _letter(None).original_value() is None
    assert _letter(b"").original_value() == b""


def test_the_raw_format_reads_back_to_the_same_letter() -> None:
    original = b"\x89PNG not a request at all" * 10
    letter = _letter(original)
    headers: list[tuple[str, bytes | None]] = [*letter.raw_headers("moderation")]
    assert ("empty", b"") in headers  # kafka-python writes no null header value
    assert (RAW_FORMAT, b"raw") in headers
    names = [k for k, _ in headers]
    for connect in ("__connect.errors.topic", "__connect.errors.exception.message"):
        assert connect in names
    back = DeadLetter.from_record(original, b"\x01key", headers)
    assert back == letter
    assert back.original_value() == original
    assert back.original_headers() == HEADERS  # the original's, not ours
    assert back.error == ERR


@pytest.mark.parametrize(
    ("value", "headers"),
    [
        (b"[1, 2]", []),  # JSON, but no dead letter
        (None, []),
        (b"x", [(RAW_FORMAT, b"raw")]),  # says raw, lacks the rest
    ],
)
def test_neither_format_is_a_value_error(
    value: bytes | None, headers: list[tuple[str, bytes | None]]
) -> None:
    with pytest.raises(ValueError):
        DeadLetter.from_record(value, None, headers)


def test_a_truncated_letter_says_so() -> None:
    letter = _letter(b"y" * 100, max_original_bytes=10)
    assert letter.truncated and letter.original_size == 100
    assert letter.original_bytes() == b"y" * 10

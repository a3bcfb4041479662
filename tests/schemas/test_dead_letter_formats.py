"""Dead letters in both formats without a broker: the JSON document keeps the original
record (value, key, headers, a tombstone's missing value) byte for byte; the raw format
(Kafka Connect's convention: the original as the record, the error in headers) reads back
to the same letter, even when the original's own headers look like ours."""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime

import pytest

from dgstream.schemas import DeadLetter, ErrorCode, RequestError
from dgstream.schemas.dead_letter import RAW_FORMAT

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


def test_a_letter_names_its_original_by_digest_unless_it_never_held_it_whole() -> None:
    assert _letter(b"{not json").original_sha256 == hashlib.sha256(b"{not json").hexdigest()
    assert _letter(None).original_sha256 is None  # a tombstone has no value to name
    # The consumer's bound kept the first bytes of a 5 MB value.
    part = _letter(b"<" * 10, complete=False, original_size=5_000_000)
    assert part.truncated and part.original_size == 5_000_000
    assert part.original_sha256 is None and part.original_bytes() == b"<" * 10


def test_a_letter_written_before_the_cut_forms_still_reads() -> None:
    """A dead letter already on a topic lacks the fields that say what was cut."""
    old = (
        b'{"schema_version":1,"error":{"code":"POISON","message":"x","field":null},'
        b'"original":"YWJj","original_null":false,"original_size":3,"truncated":false,'
        b'"source":{"topic":"t","partition":0,"offset":1,"key":"aw==","timestamp_ms":5},'
        b'"headers":[],"request_id":null,"worker":"w","time":"2026-01-01T00:00:00Z"}'
    )
    letter = DeadLetter.from_record(old, None, [])
    assert letter.original_sha256 is None and letter.headers_omitted == 0
    assert letter.source.key_sha256 is None and letter.source.key_bytes() == b"k"


@pytest.mark.parametrize(
    "update",
    [{"original_sha256": "not hex"}, {"headers_omitted": -1}, {"original_sha256": "A" * 64}],
)
def test_the_cut_fields_are_checked(update: dict[str, object]) -> None:
    doc = _letter(b"x").model_dump(mode="json")
    doc.update(update)
    with pytest.raises(ValueError):
        DeadLetter.model_validate(doc)

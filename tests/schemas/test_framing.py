"""The Confluent wire format: framing round-trips any id and payload; what is not framed is
refused NOT_FRAMED, naming the value."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dgstream.schemas import ErrorCode, RequestError
from dgstream.schemas.framing import frame, unframe

pytestmark = pytest.mark.unit


@given(st.integers(min_value=0, max_value=2**32 - 1), st.binary(max_size=200))
def test_round_trip(schema_id: int, payload: bytes) -> None:
    value = frame(schema_id, payload)
    assert value[:1] == b"\x00" and len(value) == 5 + len(payload)
    assert unframe(value) == (schema_id, payload)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (None, "no value"),
        (b"", "0 byte(s)"),
        (b"\x00\x00\x00\x01", "4 byte(s)"),
        (b'{"id": "x"}', "0x7b"),
        (b"\x01\x00\x00\x00\x01{}", "0x01"),
    ],
)
def test_not_framed(value: bytes | None, says: str) -> None:
    got = unframe(value)
    assert isinstance(got, RequestError) and got.code == ErrorCode.NOT_FRAMED
    assert says in got.message and got.message.startswith("value:")

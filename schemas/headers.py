"""A record header's key as Kafka's Java consumer reads it, whatever its bytes: the text
that logs, dead letters and comparisons see, and the bytes that go back out unchanged.
Kafka defines a header key as a string but its record format carries bytes, and producers
such as librdkafka write any."""

from __future__ import annotations

import codecs
from typing import Any

__all__ = ["HeaderKey", "java_text", "key_bytes"]


class HeaderKey(str):
    """A record header's key whose bytes are not UTF-8, as Kafka's Java consumer reads it:
    the text with each malformed sequence replaced by U+FFFD (Java decodes a header key
    with `new String(bytes, UTF_8)`), carrying the original bytes in `raw`.

    Everything that reads the key as text (logs, the dead letter's JSON, comparisons with
    our own header names) sees the replaced text; kafka-python's producer writes a key
    with `key.encode("utf-8")` (record/default_records.py), which here gives back the
    original bytes, so a key copied onto a result or a dead letter stays intact."""

    raw: bytes

    def __new__(cls, raw: bytes) -> HeaderKey:
        key = super().__new__(cls, java_text(raw))
        key.raw = bytes(raw)
        return key

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        if codecs.lookup(encoding).name == "utf-8":
            return self.raw
        return super().encode(encoding, errors)

    def __reduce__(self) -> tuple[Any, ...]:
        return HeaderKey, (self.raw,)


def java_text(raw: bytes) -> str:
    """`raw` decoded as UTF-8 the way Java's `new String(bytes, UTF_8)` does: each malformed
    sequence becomes one U+FFFD. Python's "replace" agrees (both replace the longest
    prefix of a valid sequence) except after ED followed by A0..BF, the start of an encoded
    surrogate (what Java's own "modified UTF-8" and CESU-8 write): Java takes ED and the
    continuation bytes after it (two or three) as one malformed sequence, Python each byte
    on its own (ED may only be followed by 80..9F). Checked against Kafka's console
    consumer (tests/workers/test_header_keys.py)."""
    return bytes(raw).decode("utf-8", _JAVA_REPLACE)


def _java_replace(exc: UnicodeError) -> tuple[str, int]:
    if not isinstance(exc, UnicodeDecodeError):
        raise exc
    data, at = exc.object, exc.start
    if data[at] == 0xED and at + 1 < len(data) and 0xA0 <= data[at + 1] <= 0xBF:
        end = at + 2
        if end < len(data) and 0x80 <= data[end] <= 0xBF:
            end += 1
        return "\ufffd", end
    return "\ufffd", exc.end


_JAVA_REPLACE = "dgstream-java-replace"
codecs.register_error(_JAVA_REPLACE, _java_replace)


def key_bytes(key: str) -> bytes | None:
    """The bytes of a header key that are not UTF-8 (a `HeaderKey`); None for any other."""
    return key.raw if isinstance(key, HeaderKey) else None

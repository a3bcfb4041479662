"""Dead letters: a refused message's original record, where it came from, and why.

Two formats on the dead-letter topic, both read by `DeadLetter.from_record`:

* JSON (the default): the value is a `DeadLetter` document; the original value, key and
  headers are in it, base64.
* Raw, Kafka Connect's convention, when the JSON document would not fit the topic (base64
  adds a third): the record *is* the original (value and key as they were, its headers
  first, in order) and the error follows in headers: Connect's `__connect.errors.*`
  (topic, partition, offset, connector.name = the pipeline, task.id = the worker,
  exception.class.name = the code, exception.message) and dgstream's (`error_code`,
  `dgstream.error.field`, `dgstream.request_id`, `dgstream.time`,
  `dgstream.source.timestamp_ms`, `dgstream.dead_letter.format` = "raw", and
  `dgstream.dead_letter.original_headers`: how many of the headers are the original's,
  `dgstream.dead_letter.null_headers`: which of those had no value).

Only when even the raw record would not fit does the JSON document leave part of the
original out (`truncated`): the value whole with the key or some headers left out, else a
prefix of the value, else nothing of it (by reference: the source's topic, partition and
offset, with `original_sha256` and the key's `key_sha256` to check what is found there).
Such a letter cannot be replayed byte for byte. The record's `dgstream.dead_letter.format`
header says which: `json`, `raw`, `truncated` or `reference` (`workers.steps.records`).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections.abc import Sequence
from datetime import UTC, datetime

from pydantic import Field, field_validator

from dgstream.schemas._common import WireModel
from dgstream.schemas._version import SchemaVersion
from dgstream.schemas.errors import ErrorCode, RequestError
from dgstream.schemas.headers import HeaderKey, key_bytes
from dgstream.schemas.parse import request_id_hint

# A record header as kafka-python gives and takes it.
Header = tuple[str, bytes | None]

RAW_FORMAT = "dgstream.dead_letter.format"
RAW_ORIGINAL_HEADERS = "dgstream.dead_letter.original_headers"
# Which of the original headers had no value (kafka-python writes b"" for those).
RAW_NULL_HEADERS = "dgstream.dead_letter.null_headers"
_C = "__connect.errors."


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def sha256_hex(data: bytes) -> str:
    """The SHA-256 of `data`, hex: how a letter names bytes it could not carry."""
    return hashlib.sha256(data).hexdigest()


def _text(raw: bytes | None) -> str:
    if raw is None:
        raise ValueError("a header without a value")
    return raw.decode()


def _check_b64(value: str | None) -> str | None:
    if value:
        try:
            base64.b64decode(value, validate=True)
        except binascii.Error as exc:
            raise ValueError(f"not base64: {exc}") from None
    return value


class SourceRef(WireModel):
    """Where the refused message was read."""

    topic: str
    partition: int = Field(ge=0)
    offset: int = Field(ge=0)
    key: str | None = Field(
        default=None, description="The record key, base64; null if none or left out."
    )
    key_sha256: str | None = Field(
        default=None,
        pattern="^[0-9a-f]{64}$",
        description="SHA-256 of the record key (hex) when `key` is left out (too large for "
        "the dead-letter topic); null otherwise.",
    )
    key_size: int | None = Field(
        default=None, ge=0, description="Bytes in the record key when `key` is left out."
    )
    timestamp_ms: int | None = Field(default=None, description="The record's timestamp.")

    _key_is_b64 = field_validator("key")(_check_b64)

    def key_bytes(self) -> bytes | None:
        return None if self.key is None else base64.b64decode(self.key)


class OriginalHeader(WireModel):
    """One header of the refused record."""

    key: str = Field(
        description="The header's key as text. A key whose bytes are not UTF-8 reads as "
        "Kafka's Java consumer reads it (each malformed sequence one U+FFFD); its bytes are "
        "in `key_base64`."
    )
    value: str | None = Field(description="The header's value, base64; null if none.")
    key_base64: str | None = Field(
        default=None,
        description="The key's bytes, base64, when they are not UTF-8; null for a UTF-8 key.",
    )

    _value_is_b64 = field_validator("value", "key_base64")(_check_b64)

    @classmethod
    def of(cls, key: str, value: bytes | None) -> OriginalHeader:
        raw = key_bytes(key)
        return cls(
            key=str(key),
            value=None if value is None else _b64(value),
            key_base64=None if raw is None else _b64(raw),
        )

    def original_key(self) -> str:
        """The key as the record had it: a `HeaderKey` (its own bytes) when not UTF-8."""
        if self.key_base64 is None:
            return self.key
        return HeaderKey(base64.b64decode(self.key_base64))


class DeadLetter(WireModel):
    """A message the worker refused, published on the dead-letter topic."""

    schema_version: SchemaVersion = 1
    error: RequestError
    original: str = Field(
        description="The original message value, base64 ('' for an empty or null value)."
    )
    original_null: bool = Field(
        default=False, description="The original record had no value at all (a tombstone)."
    )
    original_size: int = Field(
        ge=0,
        description="Bytes in the original message value (0 when not known: a record of a "
        "batch the worker did not read).",
    )
    truncated: bool = Field(
        default=False,
        description="Whether part of the original record is left out (the whole would not "
        "fit the dead-letter topic): `original` holds only its first bytes (or none), or "
        "the key (`source.key_sha256`) or some headers (`headers_omitted`) are left out. "
        "Such a letter cannot be replayed byte for byte.",
    )
    original_sha256: str | None = Field(
        default=None,
        pattern="^[0-9a-f]{64}$",
        description="SHA-256 of the whole original value (hex); null for a tombstone, or a "
        "value the worker never held whole. With the source's topic, partition and offset "
        "it finds and checks the original when this letter holds only part of it.",
    )
    source: SourceRef
    headers: list[OriginalHeader] = Field(
        default_factory=list,
        description="The original record's headers, in order (those left out excepted).",
    )
    headers_omitted: int = Field(
        default=0,
        ge=0,
        description="How many of the original record's headers are left out of `headers` "
        "(too large for the dead-letter topic).",
    )
    request_id: str | None = Field(
        default=None, description="The request's id, when it could be read from the message."
    )
    worker: str = Field(description="The worker that refused it.")
    time: datetime = Field(description="When it was refused (UTC, ISO 8601).")

    _original_is_b64 = field_validator("original")(_check_b64)

    @field_validator("time")
    @classmethod
    def _utc(cls, value: datetime) -> datetime:
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)

    def original_bytes(self) -> bytes:
        """The original message value (its first bytes when `truncated`)."""
        return base64.b64decode(self.original)

    def original_value(self) -> bytes | None:
        """The original value as the record had it (None for a tombstone)."""
        return None if self.original_null else self.original_bytes()

    def original_headers(self) -> list[Header]:
        return [
            (h.original_key(), None if h.value is None else base64.b64decode(h.value))
            for h in self.headers
        ]

    # ---------------------------------------------------------------- the raw format

    def raw_headers(self, pipeline: str) -> list[tuple[str, bytes]]:
        """The raw format's headers: the original's (a header without a value as b"",
        which kafka-python can write), then the error's."""
        original = [(k, b"" if v is None else v) for k, v in self.original_headers()]
        return [*original, *self.error_headers(pipeline)]

    def error_headers(self, pipeline: str) -> list[tuple[str, bytes]]:
        """The headers that follow the original's in the raw format."""
        src, err = self.source, self.error
        out = [
            (_C + "topic", src.topic),
            (_C + "partition", str(src.partition)),
            (_C + "offset", str(src.offset)),
            (_C + "connector.name", pipeline),
            (_C + "task.id", self.worker),
            (_C + "exception.class.name", err.code.value),
            (_C + "exception.message", err.message),
            ("error_code", err.code.value),
            ("dgstream.time", self.time.isoformat()),
            (RAW_FORMAT, "raw"),
            (RAW_ORIGINAL_HEADERS, str(len(self.headers))),
        ]
        nulls = [str(i) for i, h in enumerate(self.headers) if h.value is None]
        if nulls:
            out.append((RAW_NULL_HEADERS, ",".join(nulls)))
        if err.field is not None:
            out.append(("dgstream.error.field", err.field))
        if self.request_id is not None:
            out.append(("dgstream.request_id", self.request_id))
        if src.timestamp_ms is not None:
            out.append(("dgstream.source.timestamp_ms", str(src.timestamp_ms)))
        return [(k, v.encode()) for k, v in out]

    @classmethod
    def from_record(
        cls, value: bytes | None, key: bytes | None, headers: Sequence[Header] | None
    ) -> DeadLetter:
        """A record of the dead-letter topic, in either format (ValueError for neither)."""
        headers = list(headers or [])
        if (RAW_FORMAT, b"raw") not in headers:
            if value is None:
                raise ValueError("not a dead letter: no value")
            return cls.model_validate_json(value)
        return cls._from_raw(value, key, headers)

    @classmethod
    def _from_raw(cls, value: bytes | None, key: bytes | None, headers: list[Header]) -> DeadLetter:
        at = dict(headers)
        try:
            n = int(_text(at[RAW_ORIGINAL_HEADERS]))
            original, mine = headers[:n], dict(headers[n:])
            nulls = {int(i) for i in _text(mine.get(RAW_NULL_HEADERS, b"")).split(",") if i}
            original = [(k, None if i in nulls else v) for i, (k, v) in enumerate(original)]

            def get(name: str) -> str | None:
                raw = mine.get(name)
                return None if raw is None else _text(raw)

            error = RequestError(
                code=ErrorCode(get("error_code") or ""),
                message=get(_C + "exception.message") or "",
                field=get("dgstream.error.field"),
            )
            stamp = get("dgstream.source.timestamp_ms")
            return cls.build(
                error,
                value,
                get(_C + "topic") or "",
                int(get(_C + "partition") or -1),
                int(get(_C + "offset") or -1),
                key,
                None if stamp is None else int(stamp),
                get(_C + "task.id") or "",
                headers=original,
                time=datetime.fromisoformat(get("dgstream.time") or ""),
            )
        except (KeyError, ValueError, TypeError) as exc:
            raise ValueError(f"not a raw dead letter: {exc}") from exc

    @classmethod
    def build(
        cls,
        error: RequestError,
        raw: bytes | None,
        topic: str,
        partition: int,
        offset: int,
        key: bytes | None = None,
        timestamp_ms: int | None = None,
        worker: str = "",
        *,
        headers: Sequence[Header] | None = None,
        max_original_bytes: int | None = None,
        time: datetime | None = None,
        fallback_id: str | None = None,
        complete: bool = True,
        original_size: int | None = None,
    ) -> DeadLetter:
        """A dead letter for `raw`, read at topic/partition/offset with `headers`.

        `max_original_bytes` keeps only that many leading bytes of the original (base64 grows
        it by a third, which may not fit the topic's message size); `request_id` is recovered
        from the message when it is JSON with a valid `id`, else it is `fallback_id` (the
        worker passes the record's id, `schemas.parse.record_id`, for bodies without one).
        `complete=False`: `raw` is not all of the original (the consumer kept only its
        first bytes, `original_size` of them in all, or none of a batch it did not read):
        the letter is truncated and has no `original_sha256`.
        """
        data = bytes(raw) if raw else b""
        kept = data if max_original_bytes is None else data[: max(max_original_bytes, 0)]
        size = len(data) if original_size is None else original_size
        return cls(
            error=error,
            original=_b64(kept),
            original_null=raw is None,
            original_size=size,
            truncated=len(kept) < len(data) or not complete,
            original_sha256=None if raw is None or not complete else sha256_hex(data),
            source=SourceRef(
                topic=topic,
                partition=partition,
                offset=offset,
                key=None if key is None else _b64(key),
                timestamp_ms=timestamp_ms,
            ),
            headers=[OriginalHeader.of(k, v) for k, v in (headers or [])],
            request_id=(request_id_hint(data) if data else None) or fallback_id,
            worker=worker,
            time=time if time is not None else datetime.now(UTC),
        )

"""Dead letters: a refused message's original bytes, where it came from, and why."""

from __future__ import annotations

import base64
import binascii
from datetime import UTC, datetime

from pydantic import Field, field_validator

from schemas._common import WireModel
from schemas._version import SchemaVersion
from schemas.errors import RequestError
from schemas.parse import request_id_hint


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


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
    key: str | None = Field(default=None, description="The record key, base64; null if none.")
    timestamp_ms: int | None = Field(default=None, description="The record's timestamp.")

    _key_is_b64 = field_validator("key")(_check_b64)

    def key_bytes(self) -> bytes | None:
        return None if self.key is None else base64.b64decode(self.key)


class DeadLetter(WireModel):
    """A message the worker refused, published on the dead-letter topic."""

    schema_version: SchemaVersion = 1
    error: RequestError
    original: str = Field(
        description="The original message value, base64 ('' for an empty or null value)."
    )
    original_size: int = Field(ge=0, description="Bytes in the original message value.")
    truncated: bool = Field(
        default=False,
        description="Whether `original` holds only the first bytes (the whole message would "
        "not fit the dead-letter topic).",
    )
    source: SourceRef
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
        max_original_bytes: int | None = None,
        time: datetime | None = None,
        fallback_id: str | None = None,
    ) -> DeadLetter:
        """A dead letter for `raw`, read at topic/partition/offset.

        `max_original_bytes` keeps only that many leading bytes of the original (base64 grows
        it by a third, which may not fit the topic's message size); `request_id` is recovered
        from the message when it is JSON with a valid `id`, else it is `fallback_id` (the
        worker passes the record's id, `schemas.parse.record_id`, for bodies without one).
        """
        data = bytes(raw) if raw else b""
        kept = data if max_original_bytes is None else data[: max(max_original_bytes, 0)]
        return cls(
            error=error,
            original=_b64(kept),
            original_size=len(data),
            truncated=len(kept) < len(data),
            source=SourceRef(
                topic=topic,
                partition=partition,
                offset=offset,
                key=None if key is None else _b64(key),
                timestamp_ms=timestamp_ms,
            ),
            request_id=(request_id_hint(data) if data else None) or fallback_id,
            worker=worker,
            time=time if time is not None else datetime.now(UTC),
        )

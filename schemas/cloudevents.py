"""CloudEvents 1.0 on Kafka (the Kafka protocol binding), both ways.

In: a structured-mode event (the whole event, JSON, in the record's value: `specversion`,
`id`, `source`, `type`, and the request as `data`, or base64 JSON as `data_base64`) is read
by `schemas.parse_request`, which calls `unwrap` here. A binary-mode event (the request as
the value, the attributes in `ce_*` headers) is a plain request to the parser.

Out: results and dead letters carry binary-mode attributes of their own (`event_headers`):
a new `ce_id`, `ce_type` naming what the record is (`dgstream.result.v1`,
`dgstream.dead_letter.v1`), `ce_source` the pipeline (`/dgstream/<deployment>/<pipeline>`),
`ce_subject` the request's id, `ce_time`, and, when the request was itself a CloudEvent, its
id as the extension `ce_causationid`. The input's own `ce_*` and `content-type` headers are
not copied (a CloudEvents consumer would otherwise take the result for the request).
"""

from __future__ import annotations

import base64
import binascii
import uuid
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any, NamedTuple

from dgstream.schemas.errors import ErrorCode, RequestError

__all__ = [
    "CE_PREFIX",
    "CONTENT_TYPE",
    "DEAD_LETTER_TYPE",
    "RESULT_TYPE",
    "SPECVERSION",
    "STRUCTURED_CONTENT_TYPE",
    "EventRef",
    "event_headers",
    "input_event_id",
    "is_event_header",
    "is_structured",
    "unwrap",
]

SPECVERSION = "1.0"
CE_PREFIX = "ce_"
CONTENT_TYPE = "content-type"
STRUCTURED_CONTENT_TYPE = "application/cloudevents+json"
_BATCH_CONTENT_TYPE = "application/cloudevents-batch+json"
RESULT_TYPE = "dgstream.result.v1"
DEAD_LETTER_TYPE = "dgstream.dead_letter.v1"
# The extension that names the request's event (CloudEvents extension names are lower-case
# letters and digits, at most 20 characters).
CAUSATION = "causationid"
_REQUIRED = ("id", "source", "type")


class EventRef(NamedTuple):
    """The attributes of the CloudEvent a request came in (what a reply refers to)."""

    id: str
    source: str
    type: str


def is_structured(obj: Mapping[str, Any], content_type: str | None) -> bool:
    """Whether a JSON object read from a record is a structured-mode CloudEvent: the record
    says so (`content-type: application/cloudevents+json`), or the object carries
    `specversion` (no request field has that name)."""
    if content_type is not None and _media_type(content_type) in (
        STRUCTURED_CONTENT_TYPE,
        _BATCH_CONTENT_TYPE,
    ):
        return True
    return "specversion" in obj


def _media_type(content_type: str) -> str:
    return content_type.split(";", 1)[0].strip().lower()


def _bad(message: str, field: str | None) -> RequestError:
    text = f"{field}: {message}" if field else message
    return RequestError(code=ErrorCode.INVALID_CLOUDEVENT, message=text, field=field)


def _attributes(obj: Mapping[str, Any], content_type: str | None) -> EventRef | RequestError:
    if content_type is not None and _media_type(content_type) == _BATCH_CONTENT_TYPE:
        return _bad("batched CloudEvents are not accepted: send one event a record", None)
    version = obj.get("specversion")
    if version is None:
        return _bad("required attribute is missing", "specversion")
    if version != SPECVERSION:
        return _bad(f"{version!r} is not supported (CloudEvents {SPECVERSION} only)", "specversion")
    for name in _REQUIRED:
        value = obj.get(name)
        if value is None:
            return _bad("required attribute is missing", name)
        if not isinstance(value, str) or not value:
            return _bad("must be a non-empty string", name)
    media = obj.get("datacontenttype")
    if media is not None:
        if not isinstance(media, str):
            return _bad("must be a string", "datacontenttype")
        kind = _media_type(media)
        if kind != "application/json" and not kind.endswith("+json"):
            return _bad(f"{media!r}: the request is JSON (application/json)", "datacontenttype")
    return EventRef(obj["id"], obj["source"], obj["type"])


def unwrap(
    obj: Mapping[str, Any], content_type: str | None = None
) -> tuple[Any, EventRef] | RequestError:
    """(the event's data, its attributes) of a structured-mode event, or why it is refused
    (INVALID_CLOUDEVENT, naming the attribute). `data` is returned as the JSON value it
    holds; `data_base64` as the bytes it decodes to (the caller parses those as a request
    message)."""
    ref = _attributes(obj, content_type)
    if isinstance(ref, RequestError):
        return ref
    has_data, has_b64 = "data" in obj, "data_base64" in obj
    if has_data and has_b64:
        return _bad("an event holds data or data_base64, not both", "data_base64")
    if has_b64:
        encoded = obj["data_base64"]
        if not isinstance(encoded, str):
            return _bad("must be a base64 string", "data_base64")
        try:
            return base64.b64decode(encoded, validate=True), ref
        except (binascii.Error, ValueError) as exc:
            return _bad(f"not base64: {exc}", "data_base64")
    if not has_data or obj["data"] is None:
        return _bad("the event carries no data (the request)", "data")
    return obj["data"], ref


def is_event_header(name: str) -> bool:
    """Whether an input header belongs to the input's CloudEvent (binary mode), so that
    an output must not copy it: `ce_*` and `content-type`."""
    low = name.lower()
    return low.startswith(CE_PREFIX) or low == CONTENT_TYPE


def input_event_id(headers: Iterable[tuple[str, bytes | None]] | None) -> str | None:
    """The `ce_id` of a binary-mode input event, if its headers carry one (UTF-8)."""
    for name, value in headers or ():
        if name.lower() == "ce_id" and value:
            try:
                return bytes(value).decode("utf-8")
            except UnicodeDecodeError:
                return None
    return None


def event_headers(
    event_type: str,
    source: str,
    subject: str | None,
    *,
    causation: str | None = None,
    time: datetime | None = None,
    event_id: str | None = None,
) -> list[tuple[str, bytes]]:
    """The binary-mode attributes of an output record (a new id unless `event_id` is given;
    `time` now unless given)."""
    stamp = (time or datetime.now(UTC)).astimezone(UTC).isoformat().replace("+00:00", "Z")
    out = [
        ("ce_specversion", SPECVERSION),
        ("ce_id", event_id or str(uuid.uuid4())),
        ("ce_source", source),
        ("ce_type", event_type),
        ("ce_time", stamp),
        (CONTENT_TYPE, "application/json"),
    ]
    if subject is not None:
        out.append(("ce_subject", subject))
    if causation is not None:
        out.append((f"{CE_PREFIX}{CAUSATION}", causation))
    return [(k, v.encode("utf-8", "surrogatepass")) for k, v in out]

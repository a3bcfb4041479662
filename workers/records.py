"""What an output record (a result or a dead letter) carries besides its value: its key and
its headers, both taken from the input record so that consumers keep what they rely on.

- Key: the input record's key (ordering per key is what consumers rely on), else the
  request's id; None when there is neither (a dead letter of unreadable bytes).
- Headers: every input header (W3C `traceparent`/`tracestate`, anything else), in their
  order and repeats kept, then ours. Ours win a collision: an input header named like one
  of ours (compared ignoring case) is not copied, so a record never carries two `model`
  headers (a chained pipeline's input carries the previous pipeline's); with tracing on,
  our `traceparent` replaces the input's. The input's CloudEvents attributes (`ce_*`,
  `content-type`) are never copied: the output carries its own (`schemas.cloudevents`),
  else a CloudEvents consumer would take the result for the request. A null header value
  is copied as empty bytes (the Kafka client writes bytes only).

`result_record` puts it together for one result: its topic (reply topic, route, or the
output topic; in shadow mode always the output topic), key, value in the pipeline's format
with the audit of the route that matched, and headers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from schemas import Audit, ClassificationResult, ModerationOptions, OutputFormat, encode_output
from schemas.cloudevents import is_event_header
from workers.routes import Router

__all__ = [
    "OWN_HEADERS",
    "Header",
    "OutputRecord",
    "output_headers",
    "output_key",
    "result_record",
]

Header = tuple[str, bytes]

# The names the worker writes itself, on results and on dead letters. An input header of
# one of these names is replaced, whether or not this record carries ours.
OWN_HEADERS = frozenset(
    {"schema_version", "model", "worker", "error_code", "output_format", "route"}
)


def output_key(input_key: bytes | None, request_id: str | None) -> bytes | None:
    """The output record's key: the input's key, else the request id (UTF-8), else None."""
    if input_key is not None:
        return bytes(input_key)
    return None if request_id is None else request_id.encode("utf-8", "surrogatepass")


def output_headers(
    input_headers: Iterable[tuple[str, bytes | None]] | None, ours: Sequence[Header]
) -> list[Header]:
    """The input's headers without those named like ours, then `ours` (in that order)."""
    own = OWN_HEADERS | {name for name, _ in ours}
    taken = {name.lower() for name in own}
    out: list[Header] = []
    for name, value in input_headers or ():
        if name.lower() in taken or is_event_header(name):
            continue
        out.append((name, b"" if value is None else bytes(value)))
    out.extend((name, bytes(value)) for name, value in ours)
    return out


class OutputRecord(NamedTuple):
    """A record to produce, and the route that chose its topic (for the per-route counter)."""

    topic: str
    key: bytes | None
    value: bytes
    headers: list[Header]
    route: str


def result_record(
    result: ClassificationResult,
    *,
    router: Router,
    output_format: OutputFormat,
    reply_topic: str | None,
    input_key: bytes | None,
    input_headers: Iterable[tuple[str, bytes | None]] | None,
    ours: Sequence[Header],
    audit: Callable[[str], Audit] | None = None,
    shadow: bool = False,
    moderation: ModerationOptions | None = None,
    extra: Sequence[Header] = (),
) -> OutputRecord:
    """The output record of one result. `ours`: the worker's headers (schema_version, model,
    worker); `output_format`, `route` and `extra` (CloudEvents attributes, trace context)
    are added to them. `audit(route)` gives the result's audit once its route is known. In
    `shadow` mode the route is evaluated (and audited) but every result goes to the router's
    default topic, and a reply topic is ignored."""
    match = router.route(result, None if shadow else reply_topic)
    if audit is not None:
        result = result.model_copy(update={"audit": audit(match.name)})
    headers = output_headers(
        input_headers,
        [
            *ours,
            ("output_format", output_format.encode()),
            ("route", match.name.encode()),
            *extra,
        ],
    )
    key = output_key(input_key, result.id)
    topic = router.default.topic if shadow else match.topic
    value = encode_output(result, output_format, moderation)
    return OutputRecord(topic, key, value, headers, match.name)

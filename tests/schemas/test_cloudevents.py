"""CloudEvents 1.0, both ways, without a broker: structured-mode events as input (a table of
bad envelopes, properties over any valid request), and the attributes our own records
carry, read back by the `cloudevents` SDK itself. The broker round trip is in
tests/workers/test_decisions_pipeline.py."""

from __future__ import annotations

import base64
import json
from datetime import UTC, datetime
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dgstream.schemas import (
    ClassificationRequest,
    ErrorCode,
    FallbackId,
    RequestError,
    parse_request,
)
from dgstream.schemas.cloudevents import (
    DEAD_LETTER_TYPE,
    RESULT_TYPE,
    event_headers,
    input_event_id,
    is_event_header,
)
from dgstream.schemas.parse import request_id_hint

pytestmark = pytest.mark.unit

BODY: dict[str, Any] = {
    "id": "req-1",
    "state": "you are a stupid idiot",
    "questions": {"insult": {"type": "noul", "instructions": "Does it insult someone?"}},
}


def event(data: Any = BODY, **attrs: Any) -> dict[str, Any]:
    """A structured-mode event around `data`; an attribute given as None is left out."""
    base: dict[str, Any] = {
        "specversion": "1.0",
        "id": "evt-9",
        "source": "/shop/checkout",
        "type": "com.example.moderation.request",
        "datacontenttype": "application/json",
        "data": data,
    }
    base.update(attrs)
    return {k: v for k, v in base.items() if v is not None}


def raw(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _b64(obj: Any) -> str:
    return base64.b64encode(raw(obj)).decode()


# --------------------------------------------------------------------------- accepted


def test_a_structured_event_is_read_as_its_data() -> None:
    got = parse_request(raw(event()))
    assert isinstance(got, ClassificationRequest)
    bare = parse_request(raw(BODY))
    assert isinstance(bare, ClassificationRequest) and bare.event is None
    assert got.model_dump() == bare.model_dump()
    assert got.id == "req-1" and got.id_source == "request"
    assert got.event is not None
    assert (got.event.id, got.event.source, got.event.type) == (
        "evt-9",
        "/shop/checkout",
        "com.example.moderation.request",
    )


def test_a_body_without_id_takes_the_events_id_before_the_records() -> None:
    body = {k: v for k, v in BODY.items() if k != "id"}
    got = parse_request(raw(event(body)), fallback_id=FallbackId("the-key", "key"))
    assert isinstance(got, ClassificationRequest)
    assert (got.id, got.id_source) == ("evt-9", "event")
    # An event id that is no valid request id (control characters) gives way to the record's.
    got = parse_request(raw(event(body, id="bad\x01id")), fallback_id=FallbackId("k", "key"))
    assert isinstance(got, ClassificationRequest)
    assert (got.id, got.id_source) == ("k", "key")


def test_data_base64_and_json_media_types_are_accepted() -> None:
    ev = event(None, data_base64=_b64(BODY), datacontenttype="application/json; charset=utf-8")
    got = parse_request(raw(ev))
    assert isinstance(got, ClassificationRequest) and got.id == "req-1"
    ev = event(datacontenttype="application/vnd.dgstream.request+json")
    assert isinstance(parse_request(raw(ev)), ClassificationRequest)
    ev = event(datacontenttype=None, subject="x", myextension=3)  # optional attributes
    assert isinstance(parse_request(raw(ev)), ClassificationRequest)


def test_the_content_type_header_alone_makes_a_value_an_event() -> None:
    # A request object is not an event, whatever the header says: its fields are checked
    # as an event's (no specversion).
    err = parse_request(raw(BODY), content_type="application/cloudevents+json")
    assert isinstance(err, RequestError)
    assert (err.code, err.field) == (ErrorCode.INVALID_CLOUDEVENT, "specversion")
    # A plain request with any other content type is a plain request.
    got = parse_request(raw(BODY), content_type="application/json")
    assert isinstance(got, ClassificationRequest) and got.event is None


def test_the_cloudevents_sdk_s_structured_events_parse() -> None:
    from cloudevents.v1.http import CloudEvent
    from cloudevents.v1.kafka import to_structured

    msg = to_structured(CloudEvent({"type": "t.req", "source": "/p"}, BODY))
    got = parse_request(msg.value)
    assert isinstance(got, ClassificationRequest) and got.id == "req-1"
    assert got.event is not None and got.event.type == "t.req"
    # Bytes as data: the SDK writes them as data_base64.
    msg = to_structured(
        CloudEvent(
            {"type": "t.req", "source": "/p", "datacontenttype": "application/json"}, raw(BODY)
        )
    )
    assert b"data_base64" in msg.value
    got = parse_request(msg.value)
    assert isinstance(got, ClassificationRequest) and got.id == "req-1"


def test_the_new_sdk_core_structured_binding_parses_with_its_header() -> None:
    from cloudevents.core.bindings.kafka import to_structured
    from cloudevents.core.formats.json import JSONFormat
    from cloudevents.core.v1.event import CloudEvent

    ev = CloudEvent(
        attributes={"type": "t.req", "source": "/p", "id": "e-1", "specversion": "1.0"},
        data=BODY,
    )
    msg = to_structured(ev, JSONFormat())
    content_type = dict(msg.headers).get("content-type")
    assert content_type is not None and b"cloudevents" in bytes(content_type)
    got = parse_request(msg.value, content_type=bytes(content_type).decode())
    assert isinstance(got, ClassificationRequest) and got.event is not None
    assert got.event.id == "e-1"


# --------------------------------------------------------------------------- refused


E = ErrorCode
BAD_EVENTS = [
    ("no-specversion-with-header", BODY, E.INVALID_CLOUDEVENT, "specversion", True),
    ("old-specversion", event(specversion="0.3"), E.INVALID_CLOUDEVENT, "specversion", False),
    ("numeric-specversion", event(specversion=1.0), E.INVALID_CLOUDEVENT, "specversion", False),
    ("no-id", event(id=None), E.INVALID_CLOUDEVENT, "id", False),
    ("empty-id", event(id=""), E.INVALID_CLOUDEVENT, "id", False),
    ("numeric-id", event(id=7), E.INVALID_CLOUDEVENT, "id", False),
    ("no-source", event(source=None), E.INVALID_CLOUDEVENT, "source", False),
    ("no-type", event(type=None), E.INVALID_CLOUDEVENT, "type", False),
    ("xml-data", event(datacontenttype="text/xml"), E.INVALID_CLOUDEVENT, "datacontenttype", False),
    ("media-not-text", event(datacontenttype=5), E.INVALID_CLOUDEVENT, "datacontenttype", False),
    ("no-data", event(None), E.INVALID_CLOUDEVENT, "data", False),
    ("null-data", {**event(), "data": None}, E.INVALID_CLOUDEVENT, "data", False),
    (
        "data-and-base64",
        event(data_base64=_b64(BODY)),
        E.INVALID_CLOUDEVENT,
        "data_base64",
        False,
    ),
    (
        "base64-not-base64",
        event(None, data_base64="@@@"),
        E.INVALID_CLOUDEVENT,
        "data_base64",
        False,
    ),
    ("base64-not-text", event(None, data_base64=5), E.INVALID_CLOUDEVENT, "data_base64", False),
    ("data-a-string", event(raw(BODY).decode()), E.NOT_AN_OBJECT, "data", False),
    ("data-an-array", event([BODY]), E.NOT_AN_OBJECT, "data", False),
    (
        "base64-not-json",
        event(None, data_base64=base64.b64encode(b"{nope").decode()),
        E.INVALID_JSON,
        "data_base64",
        False,
    ),
    (
        "base64-not-utf8",
        event(None, data_base64=base64.b64encode(b"\xff\xfe").decode()),
        E.INVALID_UTF8,
        "data_base64",
        False,
    ),
    # Errors inside the request keep their own codes, named under data.
    ("request-field", event({**BODY, "samples": 99}), E.INVALID_SAMPLES, "data.samples", False),
    (
        "request-question",
        event({**BODY, "questions": {"q": {"type": "bogus"}}}),
        E.UNKNOWN_QUESTION_KIND,
        "data.questions.q.type",
        False,
    ),
    (
        "request-unknown-field",
        event({**BODY, "colour": 1}),
        E.UNKNOWN_FIELD,
        "data.colour",
        False,
    ),
    (
        "request-version",
        event({**BODY, "schema_version": 2}),
        E.UNSUPPORTED_SCHEMA_VERSION,
        "data.schema_version",
        False,
    ),
    (
        "request-without-questions",
        event({"id": "r", "state": "x"}),
        E.NO_QUESTIONS,
        "data.questions",
        False,
    ),
    # An event inside an event's base64 data is no request (it has no state, to begin with).
    (
        "nested-event",
        event(None, data_base64=_b64(event())),
        E.MISSING_FIELD,
        "data_base64.state",
        False,
    ),
]


@pytest.mark.parametrize(
    ("body", "code", "field", "header"),
    [pytest.param(b, c, f, h, id=n) for n, b, c, f, h in BAD_EVENTS],
)
def test_a_bad_event_is_refused_with_its_code_and_field(
    body: Any, code: ErrorCode, field: str, header: bool
) -> None:
    content_type = "application/cloudevents+json" if header else None
    err = parse_request(raw(body), content_type=content_type)
    assert isinstance(err, RequestError), err
    assert (err.code, err.field) == (code, field), err.message
    assert err.message.startswith(f"{field}: ")


def test_a_batch_of_events_is_refused_by_its_content_type() -> None:
    err = parse_request(raw([event()]), content_type="application/cloudevents-batch+json")
    assert isinstance(err, RequestError) and err.code is E.NOT_AN_OBJECT
    err = parse_request(raw(event()), content_type="application/cloudevents-batch+json")
    assert isinstance(err, RequestError) and err.code is E.INVALID_CLOUDEVENT
    assert "batched" in err.message


def test_a_refused_event_still_names_its_request_in_the_dead_letter() -> None:
    assert request_id_hint(raw(event({**BODY, "samples": 99}))) == "req-1"
    body = {k: v for k, v in BODY.items() if k != "id"}
    assert request_id_hint(raw(event({**body, "samples": 99}))) == "evt-9"


# --------------------------------------------------------------------------- properties

_text = st.text(st.characters(blacklist_categories=("Cs", "Cc")), min_size=1, max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    state=_text,
    instructions=_text.filter(lambda s: s.strip() != ""),
    ident=st.one_of(st.none(), _text),
    event_id=_text,
    source=_text,
    as_base64=st.booleans(),
)
def test_an_event_parses_to_what_its_data_parses_to(
    state: str,
    instructions: str,
    ident: str | None,
    event_id: str,
    source: str,
    as_base64: bool,
) -> None:
    body: dict[str, Any] = {
        "state": state,
        "questions": {"q": {"type": "noul", "instructions": instructions}},
    }
    if ident is not None:
        body["id"] = ident
    fallback = FallbackId(event_id, "event")
    bare = parse_request(raw(body), fallback_id=fallback)
    ev = event(None, data_base64=_b64(body)) if as_base64 else event(body)
    ev.update(id=event_id, source=source)
    wrapped = parse_request(raw(ev), fallback_id=FallbackId("k", "key"))
    if isinstance(bare, RequestError):
        assert isinstance(wrapped, RequestError)
        assert wrapped.code is bare.code
        where = "data_base64" if as_base64 else "data"
        assert wrapped.field == (where if bare.field is None else f"{where}.{bare.field}")
    else:
        assert isinstance(wrapped, ClassificationRequest)
        assert wrapped.model_dump() == bare.model_dump()
        assert wrapped.event is not None and wrapped.event.source == source


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=10),
    lambda kids: (
        st.lists(kids, max_size=3) | st.dictionaries(st.text(max_size=8), kids, max_size=3)
    ),
    max_leaves=10,
)


@settings(max_examples=300, deadline=None)
@given(
    envelope=st.dictionaries(
        st.sampled_from(
            ["specversion", "id", "source", "type", "datacontenttype", "data", "data_base64", "x"]
        ),
        _json,
    ),
    header=st.sampled_from([None, "application/cloudevents+json", "application/json"]),
)
def test_any_envelope_is_answered_never_raised(
    envelope: dict[str, Any], header: str | None
) -> None:
    envelope.setdefault("specversion", "1.0")
    got = parse_request(raw(envelope), content_type=header)
    assert isinstance(got, ClassificationRequest | RequestError)
    if isinstance(got, RequestError):
        assert got.message and (got.field is None or got.field in got.message)


# --------------------------------------------------------------------------- ours, out


def test_our_attributes_are_read_by_the_sdk_as_a_binary_mode_event() -> None:
    from cloudevents.v1.kafka import KafkaMessage, from_binary

    when = datetime(2026, 12, 2, 10, 0, 0, tzinfo=UTC)
    headers = event_headers(
        RESULT_TYPE, "/dgstream/prod/moderation", "req-1", causation="evt-9", time=when
    )
    ev = from_binary(KafkaMessage(dict(headers), b"k", b'{"id": "req-1"}'))
    assert ev["type"] == RESULT_TYPE and ev["source"] == "/dgstream/prod/moderation"
    assert ev["subject"] == "req-1" and ev["causationid"] == "evt-9"
    assert ev["specversion"] == "1.0" and ev["datacontenttype"] == "application/json"
    assert ev["time"] == "2026-12-02T10:00:00Z"
    assert ev.data == {"id": "req-1"}
    again = dict(event_headers(DEAD_LETTER_TYPE, "/s", None))
    assert again["ce_id"] != dict(headers)["ce_id"]  # a new id each time
    assert "ce_subject" not in again and "ce_causationid" not in again


def test_input_event_headers_are_recognised() -> None:
    assert all(is_event_header(h) for h in ("ce_id", "CE_TYPE", "content-type", "Content-Type"))
    assert not any(is_event_header(h) for h in ("traceparent", "model", "cex"))
    assert input_event_id([("traceparent", b"x"), ("ce_id", b"evt-1")]) == "evt-1"
    assert input_event_id([("ce_id", b"\xff")]) is None
    assert input_event_id(None) is None

"""Output records keep the input's key and headers (ours win a collision)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from kafka import TopicPartition

from dgstream.schemas import (
    ClassificationRequest,
    ClassificationResult,
    JevResponse,
    parse_request,
    read_output,
)
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.kafka.settings import KafkaConnection
from dgstream.workers.routes import Route
from dgstream.workers.steps.batches import Batch, Entry, Output
from dgstream.workers.steps.outputs import OutputBuilder
from dgstream.workers.steps.records import OWN_HEADERS, output_headers, output_key
from dgstream.workers.steps.topics import TopicGuard

pytestmark = pytest.mark.unit

TRACE = ("traceparent", b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01")
CLOUDEVENT = [
    ("ce_specversion", b"1.0"),
    ("ce_id", b"evt-42"),
    ("ce_source", b"/shop/orders"),
    ("ce_type", b"com.example.order.created"),
    ("content-type", b"application/json"),
]
OURS = [("schema_version", b"1"), ("model", b"demo"), ("worker", b"moderation-0")]


@pytest.mark.parametrize(
    ("key", "rid", "expected"),
    [
        (b"order-17", "req-1", b"order-17"),
        (b"\xff\x00binary", "req-1", b"\xff\x00binary"),
        (b"", "req-1", b""),  # an empty key is a key (it has its partition)
        (None, "req-1", b"req-1"),
        (None, "réq-✓", "réq-✓".encode()),
        (None, None, None),
    ],
)
def test_key_is_the_inputs_else_the_request_id(
    key: bytes | None, rid: str | None, expected: bytes | None
) -> None:
    assert output_key(key, rid) == expected


def test_trace_headers_are_copied_before_ours_and_cloudevents_attributes_are_not() -> None:
    # The input's CloudEvents attributes name the request's event: a result copying them
    # would be taken for the request (or a duplicate of it) by a CloudEvents consumer.
    inputs = [TRACE, ("tracestate", b"congo=t61rcWkgMzE"), *CLOUDEVENT, ("x-tenant", b"\x00\xff")]
    out = output_headers(inputs, OURS)
    assert out == [TRACE, ("tracestate", b"congo=t61rcWkgMzE"), ("x-tenant", b"\x00\xff"), *OURS]
    assert output_headers([("CE_ID", b"x"), ("Content-Type", b"a/b")], []) == []


def test_repeats_and_order_are_kept_and_null_values_become_empty() -> None:
    inputs: list[tuple[str, Any]] = [("x", b"1"), ("y", None), ("x", b"2"), ("x", bytearray(b"3"))]
    out = output_headers(inputs, [])
    assert out == [("x", b"1"), ("y", b""), ("x", b"2"), ("x", b"3")]
    assert all(type(v) is bytes for _, v in out)


def test_ours_win_a_collision_ignoring_case() -> None:
    inputs = [
        ("model", b"upstream-model"),
        ("Worker", b"upstream-0"),
        ("error_code", b"OLD"),
        ("route", b"upstream-route"),
        TRACE,
        ("my-own", b"kept"),
    ]
    out = output_headers(inputs, [*OURS, ("my-own", b"ours")])
    names = [n for n, _ in out]
    assert names == ["traceparent", "schema_version", "model", "worker", "my-own"]
    assert dict(out)["model"] == b"demo" and dict(out)["my-own"] == b"ours"
    # Our names are dropped from the input even where this record does not write them.
    assert output_headers([("error_code", b"X"), TRACE], OURS) == [TRACE, *OURS]
    assert {"schema_version", "model", "worker", "error_code"} <= OWN_HEADERS


@pytest.mark.parametrize(
    "name",
    [
        "dgstream.dead_letter.format",  # copied onto a JSON dead letter: read as a raw one
        "dgstream.shrunk",  # copied onto a whole result: said to be cut
        "dgstream.shrunk.headers",
        "dgstream.source.offset",
    ],
)
def test_an_input_header_that_would_misdescribe_an_output_is_not_copied(name: str) -> None:
    assert output_headers([(name, b"raw"), TRACE], OURS) == [TRACE, *OURS]


def test_no_input_headers() -> None:
    assert output_headers(None, OURS) == OURS
    assert output_headers([], []) == []


def _result(p_yes: float) -> ClassificationResult:
    return ClassificationResult.model_validate(
        {
            "id": "in-0-7",
            "id_source": "record",
            "status": "ok",
            "answers": {
                "toxic": {
                    "type": "yes_no",
                    "p_yes": p_yes,
                    "label": "yes" if p_yes >= 0.5 else "no",
                    "confidence": max(p_yes, 1 - p_yes),
                }
            },
            "diagnostics": {
                "reads": 1,
                "entropy": {},
                "label_mass": {},
                "model": "demo",
                "engine": "e",
                "worker": "w",
            },
        }
    )


BLOCK = Route(name="block", when="toxic.p_yes >= 0.9", topic="mod.block")


def one_output(
    result: ClassificationResult,
    *,
    output_format: str = "dgstream",
    reply_topic: str | None = None,
    key: bytes | None = None,
    headers: list[tuple[str, bytes | None]] | None = None,
) -> Output:
    """`result`'s output record as the worker's output builder makes it (no decisions)."""
    settings = WorkerSettings(
        pipeline="mod",
        input_topics=["mod.in"],
        output_topic="mod.out",
        dead_letter_topic="mod.dead",
        group_id="g",
        kafka=KafkaConnection(bootstrap_servers="127.0.0.1:9092"),
        routes=[BLOCK],
        reply_topics=["client.*"],
        output_format=output_format,
    )

    def describe(topic: str) -> tuple[dict[str, Any], int | None, str | None]:
        return {"error_code": 0, "authorized_operations": ["WRITE"]}, 1_048_588, "producer"

    class Log:
        def __getattr__(self, name: str) -> Any:
            return lambda *a, **k: None

    builder = OutputBuilder(settings, b"demo", TopicGuard(settings, describe), Log())
    body = {
        "id": result.id,
        "state": "s",
        "questions": {"toxic": {"type": "yes_no", "instructions": "Toxic?"}},
        **({"reply_topic": reply_topic} if reply_topic else {}),
    }
    request = parse_request(json.dumps(body).encode())
    assert isinstance(request, ClassificationRequest)
    entry = Entry(
        TopicPartition(
            "mod.in",
            0,
        ),
        7,
        key,
        b"{}",
        0,
        headers or [],
        request,
    )
    batch = Batch(seq=0)
    batch.add(entry)
    (out,) = asyncio.run(builder.build(batch, [result]))
    return out


@pytest.mark.parametrize(
    ("p_yes", "reply", "key", "expected"),
    [
        (0.95, None, b"k", ("mod.block", b"k", "block")),
        (0.2, None, None, ("mod.out", b"in-0-7", "default")),
        (0.95, "client.replies", None, ("client.replies", b"in-0-7", "reply")),
    ],
)
def test_a_result_record_is_routed_keyed_and_formatted(
    p_yes: float, reply: str | None, key: bytes | None, expected: tuple[str, bytes, str]
) -> None:
    rec = one_output(
        _result(p_yes),
        output_format="jev",
        reply_topic=reply,
        key=key,
        headers=[TRACE, ("route", b"upstream")],
    )
    assert (rec.topic, rec.key, rec.route, rec.dead_code) == (*expected, None)
    assert isinstance(read_output(rec.value), JevResponse)
    assert rec.headers == [
        TRACE,
        ("schema_version", b"1"),
        ("model", b"demo"),
        ("worker", b"default.mod-0"),
        ("output_format", b"jev"),
        ("route", expected[2].encode()),
    ]
    ours = one_output(_result(p_yes), reply_topic=reply, key=key)
    assert read_output(ours.value) == _result(p_yes)

"""The worker's tracing module without a broker: spans caught by the SDK's in-memory exporter
(a batch span linked to every producer context, a span per record in its producer's trace,
the injected context), trace ids read from headers, and tracing off doing nothing."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest

from dgstream.workers.results.tracing import (
    RecordRef,
    Tracing,
    TracingSettings,
    TracingUnavailable,
    trace_id_of,
)

pytestmark = pytest.mark.unit

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT = "00f067aa0ba902b7"


@pytest.fixture
def spans() -> Iterator[tuple[Any, Any]]:
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield provider, exporter
    provider.shutdown()


def _rec(offset: int, headers: list[tuple[str, bytes | None]]) -> RecordRef:
    return RecordRef("in", 2, offset, int(time.time() * 1000) - 50, headers, f"r{offset}")


def test_trace_ids_are_read_from_traceparent_headers() -> None:
    tp = f"00-{TRACE}-{PARENT}-01".encode()
    assert trace_id_of([("x", b"1"), ("TraceParent", tp)]) == TRACE
    assert (
        trace_id_of([("traceparent", b"00-" + b"0" * 32 + b"-" + PARENT.encode() + b"-01")]) is None
    )
    assert trace_id_of([("traceparent", b"garbage")]) is None
    assert trace_id_of([("traceparent", b"\xff")]) is None
    assert trace_id_of([("traceparent", None)]) is None
    assert trace_id_of(None) is None


def test_off_by_default_and_a_clear_error_without_the_sdk(monkeypatch: pytest.MonkeyPatch) -> None:
    off = Tracing.build(TracingSettings(), pipeline="p", worker="w", group="g")
    assert off.enabled is False
    off.shutdown()  # nothing to flush
    import builtins

    real = builtins.__import__

    def no_sdk(name: str, *args: Any, **kw: Any) -> Any:
        if name.startswith("opentelemetry"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_sdk)
    with pytest.raises(TracingUnavailable, match=r"tracing\.enabled"):
        Tracing.build(TracingSettings(enabled=True), pipeline="p", worker="w", group="g")


def test_a_batch_links_its_records_and_each_record_continues_its_trace(
    spans: tuple[Any, Any],
) -> None:
    provider, exporter = spans
    from opentelemetry.trace import SpanKind

    tracing = Tracing.build(
        TracingSettings(), pipeline="mod", worker="w-0", group="grp", provider=provider
    )
    assert tracing.enabled
    traced = _rec(7, [("traceparent", f"00-{TRACE}-{PARENT}-01".encode())])
    plain = _rec(8, [("k", b"v")])
    started = time.time_ns() - 5_000_000
    bt = tracing.start_batch([traced, plain], started)
    bt.waited()
    bt.begin("engine read", {"dgstream.requests": 2})
    bt.finish("engine read")
    headers = dict(bt.headers(0))
    other = dict(bt.headers(1))
    bt.begin("send")
    bt.end()
    tracing.shutdown()  # a provider handed in stays open: the exporter still has the spans

    got = {(s.name, s.context.span_id): s for s in exporter.get_finished_spans()}
    by_name: dict[str, list[Any]] = {}
    for s in got.values():
        by_name.setdefault(s.name, []).append(s)
    (batch,) = [
        s for s in by_name["process in"] if s.attributes.get("messaging.batch.message_count") == 2
    ]
    records = [s for s in by_name["process in"] if s is not batch]
    assert batch.kind is SpanKind.CONSUMER and batch.parent is None
    assert batch.attributes["messaging.system"] == "kafka"
    assert batch.attributes["messaging.operation.type"] == "process"
    assert batch.attributes["messaging.consumer.group.name"] == "grp"
    assert batch.attributes["messaging.destination.name"] == "in"
    # One link: only the first record had a producer context.
    assert [format(link.context.trace_id, "032x") for link in batch.links] == [TRACE]
    assert batch.links[0].attributes["messaging.kafka.offset"] == 7
    assert batch.start_time == started

    first = next(r for r in records if r.attributes["messaging.kafka.offset"] == 7)
    second = next(r for r in records if r.attributes["messaging.kafka.offset"] == 8)
    assert format(first.context.trace_id, "032x") == TRACE
    assert format(first.parent.span_id, "016x") == PARENT
    assert second.context.trace_id == batch.context.trace_id
    assert second.parent.span_id == batch.context.span_id
    assert first.attributes["messaging.message.id"] == "r7"
    assert first.attributes["dgstream.queue_ms"] >= 50
    assert all(r.links[0].context.span_id == batch.context.span_id for r in records)
    assert bt.trace_id(0) == TRACE

    # What goes into the output: the request's trace, the record span as the parent.
    assert headers["traceparent"].decode() == f"00-{TRACE}-{first.context.span_id:016x}-01"
    assert other["traceparent"].decode().split("-")[1] == f"{batch.context.trace_id:032x}"

    for step in ("wait", "engine read", "send"):
        (span,) = by_name[step]
        assert span.parent.span_id == batch.context.span_id
    assert by_name["wait"][0].start_time == started
    assert by_name["engine read"][0].attributes["dgstream.requests"] == 2


def test_a_failed_batch_marks_its_spans(spans: tuple[Any, Any]) -> None:
    provider, exporter = spans
    from opentelemetry.trace import StatusCode

    tracing = Tracing.build(
        TracingSettings(), pipeline="p", worker="w", group="g", provider=provider
    )
    bt = tracing.start_batch([_rec(1, [])], time.time_ns())
    bt.begin("engine read")
    bt.end(RuntimeError("engine down"))
    finished = exporter.get_finished_spans()
    assert len(finished) == 3
    assert all(s.status.status_code is StatusCode.ERROR for s in finished)
    assert "engine down" in (finished[0].status.description or "")


def test_otlp_exporters_are_built_from_the_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DG_OTLP_HEADERS", "api-key=s3cret, x=1")
    for protocol in ("http/protobuf", "grpc"):
        t = Tracing.build(
            TracingSettings(
                enabled=True,
                protocol=protocol,  # type: ignore[arg-type]
                endpoint="http://127.0.0.1:9"
                if protocol == "grpc"
                else "http://127.0.0.1:9/v1/traces",
                headers_env="DG_OTLP_HEADERS",
                timeout_s=0.2,
            ),
            pipeline="p",
            worker="w",
            group="g",
        )
        assert t.enabled
        bt = t.start_batch([_rec(1, [])], time.time_ns())
        bt.end()
        t.shutdown()  # the export fails (nothing listens), and that must not raise

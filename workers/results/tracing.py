"""OpenTelemetry traces of the worker, as OpenTelemetry's messaging conventions say for Kafka.

Per micro-batch (the worker's unit of work), when tracing is on:
- a `process <topic>` span (CONSUMER) for the batch, linked to every record's producer
  context (W3C `traceparent`/`tracestate` extracted from the record's headers: a batch has
  many parents, so they are links, not a parent), with `messaging.batch.message_count`;
  its children: `wait` (from the first record polled to the engine taking the batch: the
  consume wait), `engine read` (the classifier's call), `send` (from the first output sent
  to the last acknowledged: the produce);
- a `process <topic>` span (CONSUMER) per record, the child of that record's producer
  context (so of its trace) or, for a record without one, of the batch span, linked to the
  batch span. Its context is injected into the record's result and dead letter: same trace
  id as the request, the worker's span as the parent.

Every structured log line about a request carries the trace id (`trace_id`): the record
span's when tracing is on, else the request's own `traceparent` (read from its headers at
log time, without OpenTelemetry).

Off (the default), nothing here runs: `Tracing.enabled` is False and the worker skips every
call, so the hot path pays one attribute check per batch (bench/worker_overhead.py measures
it). Export is OTLP (`TracingSettings`), over HTTP/protobuf or gRPC, with a batching span
processor; tests hand in a provider of their own (the SDK's in-memory exporter).
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "BatchTrace",
    "RecordRef",
    "Tracing",
    "TracingSettings",
    "TracingUnavailable",
    "trace_id_of",
]

Header = tuple[str, bytes | None]

# W3C Trace Context: version 00, 32 hex trace id, 16 hex parent id, 2 hex flags; an all-zero
# id is invalid.
_TRACEPARENT = re.compile(r"^[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}")
_ZERO_TRACE = "0" * 32


class TracingSettings(BaseModel):
    """OpenTelemetry tracing of the workers (the topology's `tracing` section). Off by default."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    enabled: bool = False
    # Where spans go (OTLP). None: OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or
    # OTEL_EXPORTER_OTLP_ENDPOINT on the worker's node, else the collector's default on
    # loopback (4318 for HTTP, 4317 for gRPC).
    endpoint: str | None = None
    protocol: Literal["http/protobuf", "grpc"] = "http/protobuf"
    # Headers for the collector (an API key, say) live in an environment variable on each
    # node, named here, in OTLP's form `k1=v1,k2=v2`: a secret never goes in the file.
    headers_env: str | None = None
    # `service.name` of the workers' resource.
    service_name: str = Field(default="dgstream", min_length=1)
    # Share of new traces kept (a record with a sampled parent is always kept: ParentBased).
    # 1.0: every batch, which is cheap next to one engine call.
    sample_ratio: float = Field(default=1.0, ge=0.0, le=1.0)
    # OTLP's default export timeout.
    timeout_s: float = Field(default=10.0, gt=0)


class TracingUnavailable(RuntimeError):
    """Tracing is on, but OpenTelemetry's SDK or its OTLP exporter cannot be imported."""


def trace_id_of(headers: Iterable[Header] | None) -> str | None:
    """The trace id a record's `traceparent` header names (32 hex digits), or None."""
    for name, value in headers or ():
        if name.lower() != "traceparent" or not value:
            continue
        try:
            text = bytes(value).decode("ascii").strip().lower()
        except UnicodeDecodeError:
            return None
        m = _TRACEPARENT.match(text)
        return m.group(1) if m and m.group(1) != _ZERO_TRACE else None
    return None


class _HeaderGetter:
    """OpenTelemetry's Getter over Kafka headers: (name, bytes) pairs, names case-blind."""

    def get(self, carrier: Sequence[Header], key: str) -> list[str] | None:
        key = key.lower()
        out = []
        for name, value in carrier:
            if name.lower() == key and value is not None:
                try:
                    out.append(bytes(value).decode("ascii"))
                except UnicodeDecodeError:
                    continue
        return out or None

    def keys(self, carrier: Sequence[Header]) -> list[str]:
        return [name for name, _ in carrier]


@dataclass(frozen=True)
class RecordRef:
    """What the trace of one input record needs to know of it."""

    topic: str
    partition: int
    offset: int
    timestamp_ms: int
    headers: Sequence[Header]
    request_id: str | None = None


def _otlp_headers(env: str | None) -> dict[str, str] | None:
    if env is None:
        return None
    text = os.environ.get(env, "")
    pairs = [p.split("=", 1) for p in text.split(",") if "=" in p]
    return {k.strip(): v.strip() for k, v in pairs} or None


def _exporter(settings: TracingSettings) -> Any:
    endpoint = settings.endpoint
    kw: dict[str, Any] = {"headers": _otlp_headers(settings.headers_env)}
    if settings.protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        kw["timeout"] = settings.timeout_s
        if endpoint is not None:
            kw["endpoint"] = endpoint
        return OTLPSpanExporter(**kw)
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
        OTLPSpanExporter as HttpExporter,
    )

    kw["timeout"] = settings.timeout_s
    if endpoint is not None:
        kw["endpoint"] = endpoint
    return HttpExporter(**kw)


def _provider(settings: TracingSettings, worker: str) -> Any:
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    provider = TracerProvider(
        resource=Resource.create(
            {"service.name": settings.service_name, "service.instance.id": worker}
        ),
        sampler=ParentBased(TraceIdRatioBased(settings.sample_ratio)),
    )
    provider.add_span_processor(BatchSpanProcessor(_exporter(settings)))
    return provider


class Tracing:
    """The worker's tracer: `Tracing.build(...)`; `enabled` False means every call is skipped."""

    def __init__(
        self,
        provider: Any | None,
        *,
        pipeline: str = "",
        worker: str = "",
        group: str = "",
        own_provider: bool = False,
    ) -> None:
        self.enabled = provider is not None
        self._provider = provider
        self._own = own_provider
        self._attrs = {
            "messaging.system": "kafka",
            "messaging.operation.type": "process",
            "messaging.operation.name": "process",
            "messaging.consumer.group.name": group,
            "messaging.client.id": worker,
            "dgstream.pipeline": pipeline,
        }
        self._tracer: Any = None
        self._propagator: Any = None
        self._getter = _HeaderGetter()
        if provider is not None:
            from opentelemetry.trace.propagation.tracecontext import (
                TraceContextTextMapPropagator,
            )

            self._tracer = provider.get_tracer("dgstream.worker")
            self._propagator = TraceContextTextMapPropagator()

    @classmethod
    def disabled(cls) -> Tracing:
        return cls(None)

    @classmethod
    def build(
        cls,
        settings: TracingSettings,
        *,
        pipeline: str,
        worker: str,
        group: str,
        provider: Any | None = None,
    ) -> Tracing:
        """Off unless `settings.enabled` or a `provider` is given (tests); raises
        `TracingUnavailable` when on and OpenTelemetry cannot be imported."""
        if provider is None and not settings.enabled:
            return cls.disabled()
        own = provider is None
        try:
            if provider is None:
                provider = _provider(settings, worker)
            return cls(provider, pipeline=pipeline, worker=worker, group=group, own_provider=own)
        except ImportError as exc:
            raise TracingUnavailable(
                f"tracing is on (tracing.enabled) but OpenTelemetry cannot be imported: {exc}; "
                "install opentelemetry-sdk and opentelemetry-exporter-otlp (dgstream's own "
                "dependencies), or turn tracing off"
            ) from exc

    def start_batch(self, records: Sequence[RecordRef], started_ns: int) -> BatchTrace:
        """The spans of one batch, started at `started_ns` (its first record polled)."""
        from opentelemetry import trace
        from opentelemetry.trace import Link, SpanKind

        parents = [self._propagator.extract(r.headers, getter=self._getter) for r in records]
        contexts = [trace.get_current_span(p).get_span_context() for p in parents]
        links = [
            Link(
                c,
                {
                    "messaging.kafka.offset": r.offset,
                    "messaging.destination.partition.id": str(r.partition),
                },
            )
            for c, r in zip(contexts, records, strict=True)
            if c.is_valid
        ]
        topics = sorted({r.topic for r in records})
        attrs: dict[str, Any] = {**self._attrs, "messaging.batch.message_count": len(records)}
        if len(topics) == 1:
            attrs["messaging.destination.name"] = topics[0]
        name = f"process {topics[0]}" if len(topics) == 1 else "process"
        batch = self._tracer.start_span(
            name, kind=SpanKind.CONSUMER, attributes=attrs, links=links, start_time=started_ns
        )
        batch_ctx = trace.set_span_in_context(batch)
        now_ms = time.time() * 1000
        spans = []
        for r, parent, c in zip(records, parents, contexts, strict=True):
            rec_attrs: dict[str, Any] = {
                **self._attrs,
                "messaging.destination.name": r.topic,
                "messaging.destination.partition.id": str(r.partition),
                "messaging.kafka.offset": r.offset,
            }
            if r.request_id is not None:
                rec_attrs["messaging.message.id"] = r.request_id
            if r.timestamp_ms > 0:
                rec_attrs["dgstream.queue_ms"] = round(max(0.0, now_ms - r.timestamp_ms), 3)
            spans.append(
                self._tracer.start_span(
                    f"process {r.topic}",
                    context=parent if c.is_valid else batch_ctx,
                    kind=SpanKind.CONSUMER,
                    attributes=rec_attrs,
                    links=[Link(batch.get_span_context())],
                    start_time=started_ns,
                )
            )
        return BatchTrace(self, batch, batch_ctx, spans, started_ns)

    def inject(self, span: Any) -> list[tuple[str, bytes]]:
        """`traceparent` (and `tracestate`) headers naming `span` as the parent."""
        from opentelemetry import trace

        carrier: dict[str, str] = {}
        self._propagator.inject(carrier, context=trace.set_span_in_context(span))
        return [(k, v.encode("ascii")) for k, v in carrier.items()]

    def shutdown(self) -> None:
        """Flush and close a provider this object built (one handed in is the caller's)."""
        if self._own and self._provider is not None:
            self._provider.shutdown()


@dataclass
class BatchTrace:
    """The spans of one batch in flight (engine loop, then the producer's I/O thread)."""

    tracing: Tracing
    batch: Any
    context: Any
    records: list[Any]
    started_ns: int
    _steps: dict[str, Any] = field(default_factory=dict)

    def trace_id(self, i: int) -> str:
        """Record i's trace id (32 hex digits), for its log lines."""
        return format(self.records[i].get_span_context().trace_id, "032x")

    def headers(self, i: int) -> list[tuple[str, bytes]]:
        """The headers that make record i's span the parent of its output."""
        return self.tracing.inject(self.records[i])

    def waited(self, until_ns: int | None = None) -> None:
        """The consume wait: from the first record polled to now (the engine's turn)."""
        end = until_ns or time.time_ns()
        span = self._child("wait", self.started_ns)
        span.end(end_time=end)

    def begin(self, step: str, attributes: Mapping[str, Any] | None = None) -> None:
        """A child step starts now (`engine read`, `send`)."""
        self._steps[step] = self._child(step, time.time_ns(), attributes)

    def finish(self, step: str, error: BaseException | None = None) -> None:
        span = self._steps.pop(step, None)
        if span is not None:
            _fail(span, error)
            span.end()

    def end(self, error: BaseException | None = None) -> None:
        """Everything still open ends now (each record's span, then the batch's)."""
        for step in list(self._steps):
            self.finish(step, error)
        for span in self.records:
            _fail(span, error)
            span.end()
        _fail(self.batch, error)
        self.batch.end()

    def _child(self, name: str, start_ns: int, attributes: Mapping[str, Any] | None = None) -> Any:
        return self.tracing._tracer.start_span(
            name, context=self.context, attributes=dict(attributes or {}), start_time=start_ns
        )


def _fail(span: Any, error: BaseException | None) -> None:
    if error is None:
        return
    from opentelemetry.trace import Status, StatusCode

    span.set_status(Status(StatusCode.ERROR, f"{type(error).__name__}: {error}"[:300]))

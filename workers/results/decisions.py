"""What a worker adds to each decision besides the answer, built once per worker: the
calibration applied before the routes, the audit of each result, the CloudEvents
attributes of its records, and its traces (`workers.results.tracing`, off by default).

What they need of one record travels in one `RecordContext` (its entry, its place in the
batch, the batch's trace, its CloudEvents id), made once per record by `contexts`, instead
of as positional arguments through every call. The engine stage opens a batch's trace
(`trace_batch`) and marks its engine read; the output stage (`workers.steps.outputs`) makes the
contexts, and calibrates, audits and heads each record with them; the delivery ends the
trace when the batch's outputs are acknowledged (`end_trace`).
"""

from __future__ import annotations

import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

from dgstream.schemas import Audit, AuditImage, ClassificationRequest, ClassificationResult
from dgstream.schemas.cloudevents import (
    DEAD_LETTER_TYPE,
    RESULT_TYPE,
    event_headers,
    input_event_id,
)
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.results.audit import Auditor, checkpoint_of
from dgstream.workers.results.calibration import Calibrator
from dgstream.workers.results.tracing import BatchTrace, RecordRef, Tracing, trace_id_of
from dgstream.workers.steps.batches import Batch, Entry

__all__ = ["Decisions", "RecordContext", "contexts"]


@dataclass(frozen=True, slots=True)
class RecordContext:
    """One input record on its way to its output: what calibration, audit, CloudEvents,
    tracing and the log lines read of it."""

    entry: Entry
    index: int | None = None  # its place in the batch: its span's (None: none)
    trace: BatchTrace | None = None  # the batch's spans, while tracing is on
    event_id: str | None = None  # its output's `ce_id` (None: drawn when needed)
    # The images its request was read with, as its audit names them (set once the gate
    # checked them; none for a text-only request).
    images: tuple[AuditImage, ...] = ()

    @property
    def request(self) -> ClassificationRequest | None:
        return self.entry.request

    @property
    def source(self) -> tuple[str, int, int]:
        """Where the input record is: topic, partition, offset."""
        e = self.entry
        return e.tp.topic, e.tp.partition, e.offset

    @property
    def trace_id(self) -> str | None:
        """The trace id of the record's log lines: its span's, else its own traceparent's."""
        if self.trace is not None and self.index is not None:
            return self.trace.trace_id(self.index)
        return trace_id_of(self.entry.headers)

    @property
    def cause(self) -> str | None:
        """The CloudEvents id of the event it answers: the structured event's, else the
        binary-mode input's `ce_id`."""
        r = self.entry.request
        if r is not None and r.event is not None:
            return r.event.id
        return input_event_id(self.entry.headers)

    def trace_headers(self) -> list[tuple[str, bytes]]:
        """The headers that make its span the parent of its output (none: tracing off)."""
        if self.trace is None or self.index is None:
            return []
        return self.trace.headers(self.index)


def contexts(batch: Batch, *, event_ids: bool = False) -> list[RecordContext]:
    """A context per record of `batch`, in order; `event_ids`: each with its output's
    CloudEvents id, version-4 UUIDs drawn from one read of the OS's random source for the
    whole batch rather than one read per record."""
    trace, n = batch.trace, len(batch.entries)
    if not event_ids:
        return [RecordContext(e, i, trace) for i, e in enumerate(batch.entries)]
    raw = os.urandom(16 * n)
    return [
        RecordContext(e, i, trace, str(uuid.UUID(bytes=raw[16 * i : 16 * i + 16], version=4)))
        for i, e in enumerate(batch.entries)
    ]


class Decisions:
    """Calibration, audit, CloudEvents and tracing of one worker (engine loop)."""

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        model: str,
        canvas_length: int,
        auto: tuple[float, int],
        tracing: Tracing | None = None,
        checkpoint: tuple[str, str] | None = None,
    ) -> None:
        s = settings
        self.shadow = s.shadow
        self.source = s.event_source
        self.calibrator = Calibrator(s.calibration) if s.calibration is not None else None
        self.tracing = tracing or Tracing.disabled()
        self.auditor = Auditor(
            pipeline=s.pipeline,
            deployment=s.deployment,
            worker=s.name,
            engine=s.engine,
            model=model,
            checkpoint=checkpoint or checkpoint_of(s.engine),
            canvas_length=canvas_length,
            auto=auto,
            routes=s.routes,
            question_sets=s.question_sets,
            calibration=None if self.calibrator is None else self.calibrator.hash,
            shadow=s.shadow,
        )

    @classmethod
    def build(
        cls, settings: WorkerSettings, classifier: Any, *, tracer_provider: Any | None = None
    ) -> Decisions:
        """From the worker's settings and its classifier (the engine's model and canvas);
        `tracer_provider` replaces the OTLP export (tests: the SDK's in-memory exporter)."""
        c = classifier.settings
        tracing = Tracing.build(
            settings.tracing,
            pipeline=settings.pipeline,
            worker=settings.name,
            group=settings.group_id,
            provider=tracer_provider,
        )
        info = classifier.engine.info
        return cls(
            settings,
            model=info.model,
            canvas_length=info.canvas_length,
            auto=(c.auto_threshold, c.auto_max),
            tracing=tracing,
        )

    # ------------------------------------------------------------------ per result

    def calibrate(self, result: ClassificationResult) -> ClassificationResult:
        return result if self.calibrator is None else self.calibrator.apply(result)

    def audit(self, ctx: RecordContext, route: str) -> Audit:
        """The audit of the record's result, sent by `route`."""
        assert ctx.request is not None
        return self.auditor.audit(ctx.request, route, ctx.images)

    def result_headers(
        self, ctx: RecordContext, result: ClassificationResult
    ) -> list[tuple[str, bytes]]:
        """A result's CloudEvents attributes, and its trace context when tracing is on."""
        out = event_headers(
            RESULT_TYPE, self.source, result.id, causation=ctx.cause, event_id=ctx.event_id
        )
        return out if ctx.trace is None else [*out, *ctx.trace_headers()]

    def dead_letter_headers(
        self, ctx: RecordContext, request_id: str | None
    ) -> list[tuple[str, bytes]]:
        cause = ctx.cause or input_event_id(ctx.entry.headers)
        out = event_headers(
            DEAD_LETTER_TYPE, self.source, request_id, causation=cause, event_id=ctx.event_id
        )
        return out if ctx.trace is None else [*out, *ctx.trace_headers()]

    # ------------------------------------------------------------------ per batch

    @staticmethod
    def contexts(batch: Batch) -> list[RecordContext]:
        """The batch's record contexts, each with its output's CloudEvents id."""
        return contexts(batch, event_ids=True)

    def trace_batch(self, batch: Batch) -> BatchTrace | None:
        """The batch's spans (None when tracing is off), its consume wait already recorded
        and its engine read begun."""
        if not self.tracing.enabled:
            return None
        now_ns = time.time_ns()
        started = now_ns - int((time.monotonic() - batch.started) * 1e9)
        records = [
            RecordRef(
                e.tp.topic,
                e.tp.partition,
                e.offset,
                e.timestamp_ms,
                e.headers,
                e.request.id if e.request is not None else e.fallback_id,
            )
            for e in batch.entries
        ]
        trace = self.tracing.start_batch(records, started)
        trace.waited(now_ns)
        trace.begin(
            "engine read", {"dgstream.requests": sum(e.request is not None for e in batch.entries)}
        )
        return trace

    @staticmethod
    def end_trace(batch: Batch, error: BaseException | None = None) -> None:
        """The batch is done (acknowledged, or failed): its spans end."""
        trace, batch.trace = batch.trace, None
        if trace is not None:
            trace.end(error)

    def close(self) -> None:
        self.tracing.shutdown()

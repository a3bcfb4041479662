"""What a worker adds to each decision besides the answer, built once per worker: the
calibration applied before the routes, the audit of each result, the CloudEvents
attributes of its records, and its traces (`workers.tracing`, off by default).

The engine stage opens a batch's trace (`trace_batch`) and marks its engine read; the
output stage (`workers.outputs`) calibrates, audits and heads each record with it; the
delivery ends the trace when the batch's outputs are acknowledged (`end_trace`).
"""

from __future__ import annotations

import time
from typing import Any

from schemas import ClassificationRequest, ClassificationResult
from schemas.cloudevents import DEAD_LETTER_TYPE, RESULT_TYPE, event_headers, input_event_id
from workers.audit import Auditor, checkpoint_of
from workers.batches import Batch, Entry
from workers.calibration import Calibrator
from workers.settings import WorkerSettings
from workers.tracing import BatchTrace, RecordRef, Tracing, trace_id_of

__all__ = ["Decisions"]


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

    def result_headers(
        self,
        entry: Entry,
        request: ClassificationRequest,
        result: ClassificationResult,
        i: int,
        trace: BatchTrace | None,
    ) -> list[tuple[str, bytes]]:
        """A result's CloudEvents attributes, and its trace context when tracing is on."""
        cause = request.event.id if request.event is not None else input_event_id(entry.headers)
        out = event_headers(RESULT_TYPE, self.source, result.id, causation=cause)
        return out if trace is None else [*out, *trace.headers(i)]

    def dead_letter_headers(
        self, entry: Entry, request_id: str | None, i: int | None, trace: BatchTrace | None
    ) -> list[tuple[str, bytes]]:
        cause = entry.request.event.id if entry.request and entry.request.event else None
        out = event_headers(
            DEAD_LETTER_TYPE,
            self.source,
            request_id,
            causation=cause or input_event_id(entry.headers),
        )
        return out if trace is None or i is None else [*out, *trace.headers(i)]

    @staticmethod
    def trace_id(entry: Entry, i: int | None, trace: BatchTrace | None) -> str | None:
        """The trace id of a request's log lines: its span's, else its own traceparent's."""
        if trace is not None and i is not None:
            return trace.trace_id(i)
        return trace_id_of(entry.headers)

    # ------------------------------------------------------------------ per batch

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

"""The engine stage: the engine loop's thread, an asyncio loop that owns the `Classifier`.

Per batch, in submission order: classify every request at once (`workers.steps.classify`),
build the outputs (`workers.steps.outputs.OutputBuilder`, the one owner of a result's way to its
bytes, from each record's context made here), then, once the previous batch's outputs went,
hand them to delivery (the `send` it was given): per-partition order is kept while the
next batch is already at the engine. A batch that fails goes to the completion queue
with its error, raw: the error table (`workers.stream.actions`) decides what it does.
Nothing here runs on another thread but `start`, `submit` and `stop` (the consumer
thread's calls into the loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future as ConcurrentFuture
from typing import Any

from dgstream.workers.engine.classifier import Classifier
from dgstream.workers.images import InputGate
from dgstream.workers.results.decisions import Decisions, RecordContext
from dgstream.workers.steps.batches import Batch, Output
from dgstream.workers.steps.classify import BatchClassifier
from dgstream.workers.steps.outputs import OutputBuilder
from dgstream.workers.stream.shared import CLOSE_TIMEOUT_S, Completions, Shared

__all__ = ["EngineStage", "with_images"]


class EngineStage:
    """Steps 7-9 of the worker (docs/worker.md), on a thread of their own."""

    def __init__(self, shared: Shared, completions: Completions) -> None:
        self._s = shared
        self._completions = completions
        self.classifier: Classifier | None = None
        # What it hands each batch to, once the engine is up (`attach`).
        self._outputs: OutputBuilder | None = None
        self._send: Callable[[Batch, list[Output]], None] | None = None
        self._decisions: Decisions | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._send_turn: asyncio.Event | None = None  # the last batch submitted's

    def start(self, classifier: Classifier | None) -> Classifier:
        """Start the loop and build the engine on it (an in-process vLLM binds to the loop
        it starts on); `classifier` replaces the one the settings describe."""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name=f"{self._s.settings.name}-engine", daemon=True
        )
        self._thread.start()
        self.classifier = self._on_loop(self._build(classifier)).result()
        return self.classifier

    def attach(
        self,
        outputs: OutputBuilder,
        send: Callable[[Batch, list[Output]], None],
        decisions: Decisions,
    ) -> None:
        """What a batch goes through after the engine: the output builder (whose result
        headers name the engine's model), delivery's `send`, and the batch's traces."""
        self._outputs, self._send, self._decisions = outputs, send, decisions

    async def _build(self, classifier: Classifier | None) -> Classifier:
        if classifier is not None:
            return classifier
        from dgstream.workers.engine.factory import build_classifier

        s = self._s.settings
        return build_classifier(s.engine, s.question_sets, s.name)

    def submit(self, batch: Batch) -> None:
        """The batch to the engine (consumer thread); it ends in the completion queue."""
        self._on_loop(self._process(batch))

    async def _process(self, batch: Batch) -> None:
        prev, mine = self._send_turn, asyncio.Event()
        self._send_turn = mine
        try:
            ctxs, outcomes = await self._classify(batch)
            assert self._outputs is not None and self._send is not None
            outputs = await self._outputs.build(batch, outcomes, ctxs)
            if prev is not None:
                await prev.wait()
            if batch.trace is not None:
                batch.trace.begin("send", {"dgstream.outputs": len(outputs)})
            self._send(batch, outputs)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._completions.failed(batch, exc)
        finally:
            mine.set()  # the next batch's outputs may go (a failed one sends nothing more)

    async def _classify(self, batch: Batch) -> tuple[list[RecordContext], list[Any]]:
        """Step 7: every request of the batch through the classifier, in one call; the
        records' contexts (made once the batch's trace is open) and the outcomes."""
        s, metrics = self._s, self._s.metrics
        t0 = time.perf_counter()
        try:
            requests = [e.request for e in batch.entries if e.request is not None]
            assert self.classifier is not None and self._decisions is not None
            settings = s.settings
            batch.trace = self._decisions.trace_batch(batch)  # None: tracing is off
            ctxs = self._decisions.contexts(batch)
            step = BatchClassifier(
                self.classifier,
                settings.engine_retries,
                settings.engine_retry_backoff_s,
                s.log,
                trace_ids=_trace_ids(ctxs),
                gate=InputGate(settings.images, self.classifier.engine.info),
            )
            outcomes = await step.classify(requests) if requests else []
            # The images each request was read with, for its audit (text-only ones keep
            # their context as it is).
            ctxs = [with_images(c, step) for c in ctxs]
        finally:
            s.classified += 1  # answered or failed: the engine is free (`Shared.engine_idle`)
            if batch.trace is not None:
                batch.trace.finish("engine read")
        metrics.record_batch(len(batch))
        if requests:
            metrics.record_engine(time.perf_counter() - t0, step.calls)
        return ctxs, outcomes

    def _on_loop(self, coro: Any) -> ConcurrentFuture[Any]:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def stop(self) -> None:
        """Close the engine, cancel what is left on the loop, stop the thread (bounded)."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        if self.classifier is not None:
            with contextlib.suppress(Exception):
                self._on_loop(self.classifier.engine.close()).result(CLOSE_TIMEOUT_S)

        async def _cancel_rest() -> None:
            me = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not me:
                    task.cancel()

        with contextlib.suppress(Exception):
            self._on_loop(_cancel_rest()).result(CLOSE_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(CLOSE_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()


def with_images(ctx: RecordContext, step: BatchClassifier) -> RecordContext:
    """`ctx` with the images its request was read with (the same context when none)."""
    images = step.images_of(ctx.request) if ctx.request is not None else ()
    return dataclasses.replace(ctx, images=images) if images else ctx


def _trace_ids(ctxs: list[RecordContext]) -> dict[str, str]:
    """Request id -> trace id, for the engine stage's log lines about a request."""
    out = {}
    for ctx in ctxs:
        if ctx.request is not None:
            tid = ctx.trace_id
            if tid is not None:
                out[ctx.request.id] = tid
    return out

"""The stream worker: consume requests, answer them in micro-batches, publish, lose nothing.

`StreamWorker` is plain Python (threads and one asyncio loop) so it runs and is tested
without Ray; `workers.hosting.actor.WorkerActor` wraps it for the pool. It is the public face
(run, drain, stop, status, report) over the roles of `workers.stream`, one module each:
the consume loop, intake, partition ownership, the engine stage, recovery and delivery.
It builds them, hands each the shared state, the completion queue and the ports it needs,
and closes everything on the way out. docs/worker.md walks through the busy loop step by
step; docs/architecture.md draws the roles, their threads and the error table.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Literal

import structlog
from kafka import KafkaAdminClient

from dgstream.workers.engine.classifier import Classifier
from dgstream.workers.faults.errors import WorkerFailed
from dgstream.workers.faults.poll_errors import unreadable_batch
from dgstream.workers.hosting.heap import freeze_startup_heap
from dgstream.workers.hosting.logs import configure_logging, get_logger, quiet_kafka_debug
from dgstream.workers.hosting.metrics import WorkerMetrics
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.hosting.status import Stall, StallWatch
from dgstream.workers.kafka.admin import subscribe_known
from dgstream.workers.results.decisions import Decisions
from dgstream.workers.steps.batches import tp_name
from dgstream.workers.steps.outputs import OutputBuilder
from dgstream.workers.steps.topics import TopicGuard, admin_describe
from dgstream.workers.stream.delivery import Delivery, delivery_for
from dgstream.workers.stream.engine_stage import EngineStage
from dgstream.workers.stream.intake import Intake
from dgstream.workers.stream.loop import ConsumeLoop
from dgstream.workers.stream.ownership import Listener, Ownership, make_consumer, membership
from dgstream.workers.stream.recovery import Recovery
from dgstream.workers.stream.shared import CLOSE_TIMEOUT_S, Completions, Shared

__all__ = ["StreamWorker", "WorkerFailed", "WorkerState"]

WorkerState = Literal["new", "starting", "running", "draining", "stopping", "stopped", "failed"]


class StreamWorker:
    """One consumer-group member with one engine. `run()` blocks; the rest are thread-safe.

    `classifier` replaces the one built from `settings.engine` (tests inject failing
    engines this way; the benchmark shares one between variants). `tracer_provider`
    replaces the OTLP export of `settings.tracing` (tests: the SDK's in-memory exporter).
    `freeze_heap`: the worker owns its process (the pool's actor does), so once its engine
    and clients are built, what is alive then moves out of the garbage collector's sight
    (`freeze_startup_heap`); a worker sharing a process with other code leaves it alone.
    """

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        classifier: Classifier | None = None,
        tracer_provider: Any | None = None,
        freeze_heap: bool = False,
    ) -> None:
        self.settings = settings
        self._freeze_heap = freeze_heap
        self.name = settings.name
        self._classifier = classifier
        self._tracer_provider = tracer_provider
        if not structlog.is_configured():
            configure_logging(settings.log_level)
        quiet_kafka_debug()
        self.metrics = WorkerMetrics(settings.pipeline, self.name)
        log = get_logger(worker=self.name, pipeline=settings.pipeline)
        self._shared = Shared(settings, log, self.metrics)
        self._completions = Completions()
        self._state: WorkerState = "new"
        self._stop = threading.Event()
        self._drain = threading.Event()
        self._finished = threading.Event()
        self._started_at: float | None = None
        self._summary: dict[str, Any] = {}
        # STALLED: held records whose committed offsets do not move (`workers.hosting.status`).
        self._stalls = StallWatch(self._shared, lambda: self._consumer, lambda: self._state)
        # The clients and the roles, built by run() (`_setup`).
        self._consumer: Any = None
        self._admin: Any = None
        self._engine: EngineStage | None = None
        self._delivery: Delivery | None = None
        self._ownership: Ownership | None = None
        self._recovery: Recovery | None = None
        self._loop: ConsumeLoop | None = None
        self._decisions: Decisions | None = None  # calibration, audit, CloudEvents, traces

    @property
    def log(self) -> Any:
        return self._shared.log

    @log.setter
    def log(self, log: Any) -> None:  # a test's wrapper (bench/harness/faults.py, LogTap)
        self._shared.log = log

    # ================================================================== public API

    def run(self) -> dict[str, Any]:
        """Consume until `drain()` or `stop()`; returns a summary. Raises `WorkerFailed`."""
        with self._shared.lock:
            if self._state != "new":
                raise RuntimeError(f"run() needs a new worker (this one is {self._state})")
            self._state = "starting"
        self._started_at = time.time()
        try:
            loop = self._loop = self._setup()
            if self._freeze_heap:
                frozen = freeze_startup_heap()
                self.log.info("heap_frozen", objects=frozen)
            with self._shared.lock:
                if self._state == "starting":
                    self._state = "running"
            self.log.info(
                "worker_started",
                topics=list(self.settings.input_topics),
                group=self.settings.group_id,
                delivery=self.settings.delivery,
                static=self.settings.static_membership,
            )
            loop.run(self._stop, self._drain)
        except BaseException as caught:
            # A batch the consumer cannot read is named (what and where), not a bare error.
            exc = unreadable_batch(caught, self._consumer) or caught
            error = f"{type(exc).__name__}: {exc}"
            self._completions.last_error = error
            self.log.error("worker_failed", error=error, exc_info=True)
            if exc is not caught and self._loop is not None:
                # What was read before that batch is finished and committed, as in a
                # drain: the group's offset stands at the batch (no work redone, ever).
                with contextlib.suppress(Exception):
                    self._loop.finish_in_flight()
            self._finish("failed")
            if exc is not caught:
                raise exc from caught
            if isinstance(exc, WorkerFailed):
                raise
            raise WorkerFailed(error) from exc
        self._finish("stopped")
        self.log.info("worker_stopped", **self._summary)
        return self.status()

    def drain(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Stop fetching, finish the batches in flight, commit, leave the group.

        Blocks until `run()` has returned (at most `timeout_s`, default the settings'
        drain timeout plus the client close bound); returns `status()`."""
        if self._leave("draining", ("running", "starting")):
            self._drain.set()
            self._completions.wake()
            limit = timeout_s if timeout_s is not None else self.settings.drain_timeout_s
            self._finished.wait(limit + CLOSE_TIMEOUT_S)
        return self.status()

    def stop(self, timeout_s: float = CLOSE_TIMEOUT_S * 2) -> dict[str, Any]:
        """Leave at once: batches in flight are abandoned (consumed again by the partitions'
        next owner); only acknowledged work is committed."""
        if self._leave("stopping", ("new", "starting", "running", "draining", "stopping")):
            self._stop.set()
            self._completions.wake()
            self._finished.wait(timeout_s)
        return self.status()

    def _leave(self, state: WorkerState, from_states: tuple[str, ...]) -> bool:
        """drain()'s and stop()'s common start: a new worker stops at once (False); else
        the state moves to `state` when it is one of `from_states`, and True."""
        with self._shared.lock:
            if self._state == "new":
                self._state = "stopped"
                self._finished.set()
                return False
            if self._state in from_states:
                self._state = state
        return True

    def status(self) -> dict[str, Any]:
        """Counters and state, safe to call from any thread."""
        s = self._shared
        committed = {tp_name(tp): off for tp, off in dict(s.offsets.committed).items()}
        return {
            "worker": self.name,
            "pipeline": self.settings.pipeline,
            "state": self._state,
            "delivery": self.settings.delivery,
            "assignment": sorted(tp_name(tp) for tp in s.assignment),
            "committed": committed,
            "uptime_s": round(time.time() - self._started_at, 3) if self._started_at else 0.0,
            "last_error": self._completions.last_error,
            "group": membership(self._consumer),
            "outage": s.outage.status(),
            "metrics_exported": self.metrics.exported,  # to Ray's metrics (under Ray)
            **self._stalls.status(),  # stall_after_s, progress, stall
            **self.metrics.snapshot(),
        }

    def stall(self) -> Stall | None:
        """Why the worker is stalled (`workers.hosting.status.StallWatch`), or None. Any thread."""
        return self._stalls.read()[1]

    def report(self) -> tuple[WorkerState, int, int, float]:
        """(state, answered, dead-lettered, engine seconds): what the controller reads."""
        m = self.metrics
        return self._state, m.answered, m.dead_lettered, m.engine_seconds

    @property
    def state(self) -> WorkerState:
        return self._state

    def wait_finished(self, timeout_s: float | None = None) -> bool:
        return self._finished.wait(timeout_s)

    # ================================================================== setup / teardown

    def _setup(self) -> ConsumeLoop:
        """The clients and the roles, in the order each needs the one before."""
        s, shared, done = self.settings, self._shared, self._completions
        client = f"{s.kafka.client_id}-{self.name}"
        engine = self._engine = EngineStage(shared, done)
        classifier = engine.start(self._classifier)
        # Where outputs may go and how large they may be: asked on a connection of its own
        # (one request, answered at once, where the producer would wait for metadata).
        self._admin = KafkaAdminClient(**s.kafka.client_kwargs(client_id=f"{client}-admin"))
        topics = TopicGuard(s, admin_describe(self._admin))
        delivery = self._delivery = delivery_for(shared, done, topics, client)
        delivery.open_producer()
        for topic in (s.output_topic, s.dead_letter_topic):
            topics.lookup(topic)  # their max.message.bytes (a failure keeps the default)
        model = classifier.engine.info.model.encode()
        decisions = self._decisions = Decisions.build(
            s, classifier, tracer_provider=self._tracer_provider
        )
        outputs = OutputBuilder(s, model, topics, shared.log, decisions)
        engine.attach(outputs, delivery.send, decisions)
        consumer = self._consumer = make_consumer(s, client)
        delivery.open_committer(consumer)
        recovery = self._recovery = Recovery(shared, done, delivery, consumer)
        ownership = self._ownership = Ownership(shared, done, recovery, delivery, consumer)
        subscribe_known(consumer, s.input_topics, listener=Listener(ownership))
        intake = Intake(shared, done, consumer)
        return ConsumeLoop(
            shared,
            done,
            intake=intake,
            ownership=ownership,
            recovery=recovery,
            delivery=delivery,
            engine=engine,
        )

    def _finish(self, state: WorkerState) -> None:
        """Close everything (never raises), then the final state."""
        failed = state == "failed"
        shared = self._shared
        shared.closing = True
        if (failed or self._stop.is_set()) and self._recovery is not None:
            # Nothing in flight may reach the output after this (exactly-once: the open
            # transaction is aborted rather than left to its timeout).
            with contextlib.suppress(Exception):
                self._recovery.abandon("stopping" if not failed else "failed")
        self._close_clients(failed)
        if self._engine is not None:
            self._engine.stop()
        if self._decisions is not None:
            with contextlib.suppress(Exception):
                self._decisions.close()  # flushes the spans still buffered
        self.metrics.set_in_flight(0)
        self._summary = {
            "consumed": self.metrics.consumed,
            "answered": self.metrics.answered,
            "dead_lettered": self.metrics.dead_lettered,
            "committed": {tp_name(tp): o for tp, o in sorted(shared.offsets.committed.items())},
        }
        with shared.lock:
            self._state = state
        self._finished.set()

    def _close_clients(self, failed: bool) -> None:
        if self._consumer is not None:
            try:
                self._consumer.close(autocommit=False, timeout_ms=int(CLOSE_TIMEOUT_S * 1000))
            except Exception as exc:
                self.log.warning("consumer_close_failed", error=str(exc))
        drained = not failed and self._drain.is_set() and not self._stop.is_set()
        if drained and self.settings.static_membership and self._ownership is not None:
            self._ownership.remove_static_member()
        if self._delivery is not None:
            self._delivery.close()
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()

"""The stream worker: consume requests, answer them in micro-batches, publish, lose nothing.

`StreamWorker` is plain Python (threads and one asyncio loop) so it runs and is tested
without Ray; `workers.actor.WorkerActor` wraps it for the pool. The consumer thread owns the
`KafkaConsumer` (kafka-python's is not thread-safe) and polls, parses, submits and commits;
the engine loop owns the `Classifier` and answers and produces each batch in submission
order. docs/worker.md walks through the busy loop step by step (the numbered comments
below follow it), rebalances, outages and abandoning open work.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import queue
import threading
import time
from concurrent.futures import Future as ConcurrentFuture
from typing import Any, Literal

import structlog
from kafka import (
    ConsumerRebalanceListener,
    KafkaAdminClient,
    KafkaConsumer,
    KafkaProducer,
    TopicPartition,
)
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor
from kafka.errors import KafkaError

from schemas import (
    ErrorCode,
    RequestError,
    record_id,
)
from schemas.cloudevents import CONTENT_TYPE
from workers.batches import Batch, Entry, Output, tp_name
from workers.classify import BatchClassifier
from workers.commit import (
    AtLeastOnceCommitter,
    Committer,
    ExactlyOnceCommitter,
    Marks,
    OffsetTracker,
    fenced,
)
from workers.decisions import Decisions
from workers.engine.classifier import Classifier
from workers.engine.types import FatalEngineError
from workers.errors import CommitRefused, OutputFailed, Redo, WorkerFailed
from workers.inputs import InputReader
from workers.kafka_admin import admin_client, subscribe_known
from workers.logs import configure_logging, get_logger, quiet_kafka_debug
from workers.metrics import WorkerMetrics
from workers.outage import Outage, OutageClock, produce_outage
from workers.outputs import OutputBuilder
from workers.poison import PoisonGuard
from workers.poll_errors import unreadable_batch
from workers.settings import WorkerSettings
from workers.topics import TopicGuard, admin_describe

__all__ = ["StreamWorker", "WorkerFailed", "WorkerState"]

WorkerState = Literal["new", "starting", "running", "draining", "stopping", "stopped", "failed"]

# When every batch slot is taken, wait this long for a completion before looking again:
# short against one batch (tens of milliseconds with the fake engine on a CPU), so a
# freed slot is refilled at once. Completions also wake the loop directly.
_FULL_WAIT_S = 0.05
# While full, still call poll() at least this often, so the heartbeat thread's
# poll-interval check (max_poll_interval_ms) and rebalances see a live member. One second:
# well below any sane max_poll_interval_ms, and rebalances wait for this member's rejoin.
_FULL_POLL_EVERY_S = 1.0
# A rejoin is pending: poll this long at a time, and commit nothing in between, so the
# JoinGroup/SyncGroup round trip (which waits for the other members) completes inside
# poll() rather than between calls: kafka-python 3.0 (coordinator/base.py,
# join_group_async) takes a join's result only while a poll() waits on it, and sends a new
# JoinGroup when it finished meanwhile; a leader's new JoinGroup starts a new rebalance.
# A join waits on the slowest member (seconds when one is busy, a member's session when
# one is frozen); 2 s bounds how late the loop sees a stop or a drain meanwhile.
_REJOIN_POLL_MS = 2_000
# When nothing is in flight and no batch is being filled, poll waits this long for data
# (it returns as soon as some arrives; the bound only sets how often control is checked).
_IDLE_POLL_MS = 100
# Lag per partition is recomputed at most this often (local reads only; the autoscaler
# polls every 5 s by default).
_LAG_EVERY_S = 0.5
# Close the clients within this bound on the way out.
_CLOSE_TIMEOUT_S = 10.0
# A committed-offset lookup (one OffsetFetch round trip to the group coordinator) gives up
# after this long: kafka-python retries it without a bound while the coordinator is unknown
# or answers a retriable error (UNSTABLE_OFFSET_COMMIT while an open transaction holds
# offsets of the partition, until that transaction ends), and the consumer thread blocked
# there neither polls nor commits. 10 s: a quarter of the default session timeout (45 s),
# long against a round trip on a loaded loopback broker (milliseconds).
_OFFSET_FETCH_TIMEOUT_MS = 10_000
# An output the broker refuses for good reads the open work again at once, this many times
# in a row at most (one suffices once the output check knows the topic's new limit or
# ACLs); past that, the refusals are handled as an outage: backoff, within the budget.
_REDO_LIMIT = 3


# ------------------------------------------------------------------------------ rebalances


class _Listener(ConsumerRebalanceListener):
    """Runs on kafka-python's I/O thread while the consumer thread is inside poll()."""

    def __init__(self, worker: StreamWorker) -> None:
        self._worker = worker

    def on_partitions_revoked(self, revoked: Any) -> None:
        self._worker._on_revoked(set(revoked), lost=False)

    def on_partitions_assigned(self, assigned: Any) -> None:
        self._worker._on_assigned(set(assigned))

    def on_partitions_lost(self, lost: Any) -> None:
        self._worker._on_revoked(set(lost), lost=True)


# ------------------------------------------------------------------------------ the worker


def _no_auto_create(producer: Any) -> None:
    """kafka-python 3.0 drops the producer's allow_auto_create_topics (net/manager.py
    builds the cluster metadata without it), so its metadata requests ask the broker to
    create any topic they name: a reply_topic with a typo would be created. Set it where
    the requests read it."""
    config = getattr(getattr(producer, "_metadata", None), "config", None)
    if isinstance(config, dict) and "allow_auto_create_topics" in config:
        config["allow_auto_create_topics"] = False


class StreamWorker:
    """One consumer-group member with one engine. `run()` blocks; the rest are thread-safe.

    `classifier` replaces the one built from `settings.engine` (tests inject failing
    engines this way; the benchmark shares one between variants). `tracer_provider`
    replaces the OTLP export of `settings.tracing` (tests: the SDK's in-memory exporter).
    """

    def __init__(
        self,
        settings: WorkerSettings,
        *,
        classifier: Classifier | None = None,
        tracer_provider: Any | None = None,
    ) -> None:
        self.settings = settings
        self._tracer_provider = tracer_provider
        self._decisions: Decisions | None = None
        self.name = settings.name
        self._classifier = classifier
        self._eos = settings.delivery == "exactly_once"
        if not structlog.is_configured():
            configure_logging(settings.log_level)
        quiet_kafka_debug()
        self.log = get_logger(worker=self.name, pipeline=settings.pipeline)
        self._debug = settings.log_level == "DEBUG"  # per-request "answered" events
        self.metrics = WorkerMetrics(settings.pipeline, self.name)
        self._inputs = InputReader(settings, self.metrics, self.log)

        self._state: WorkerState = "new"
        self._state_lock = threading.RLock()  # consumer-thread bookkeeping vs the listener
        self._stop = threading.Event()
        self._drain = threading.Event()
        self._finished = threading.Event()
        self._wake = threading.Event()
        self._done_q: queue.SimpleQueue[tuple[Batch, BaseException | None]] = queue.SimpleQueue()
        self._failure: BaseException | None = None
        self._last_error: str | None = None
        self._started_at: float | None = None
        self._summary: dict[str, Any] = {}

        self._consumer: Any = None
        self._producer: Any = None
        self._committer: Committer | None = None
        self._txn: ExactlyOnceCommitter | None = None  # the committer, under exactly-once
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: threading.Thread | None = None
        self._model = b""

        self._seq = 0
        self._acc: Batch | None = None  # the batch being filled
        self._offsets = OffsetTracker()
        self._assignment: set[TopicPartition] = set()
        # Where to read again after open work was abandoned (consumer thread applies it):
        # the group's committed offset, else this first offset polled.
        self._rewind: dict[TopicPartition, int] = {}
        self._member = ""  # the member id the work in flight was fetched under
        self._outage = OutageClock(settings.outage)  # consumer thread (and listener)
        self._closing = False  # teardown under way: the listener only forgets partitions
        self._last_poll = 0.0
        self._last_lag = 0.0
        self._submitted = 0  # written by the consumer thread
        self._classified = 0  # written by the engine loop
        self._send_turn: asyncio.Event | None = None  # engine loop only

        self._admin: Any = None
        self._topics: TopicGuard | None = None
        self._builder: OutputBuilder | None = None
        # The last error an output met (producer I/O thread): what an exactly-once commit
        # that failed with kafka-python's generic "error state" was about.
        self._last_output_error: BaseException | None = None
        self._redo_streak = 0  # reads again in a row without a commit in between
        b = settings.batching
        self._poison = PoisonGuard(settings.poison, b.max_in_flight * b.max_records)
        self._marks: dict[TopicPartition, tuple[int, str]] = {}  # to commit before submitting
        self._producer_broken = False  # set by an abort that failed: reset before new work

    # ================================================================== public API

    def run(self) -> dict[str, Any]:
        """Consume until `drain()` or `stop()`; returns a summary. Raises `WorkerFailed`."""
        with self._state_lock:
            if self._state != "new":
                raise RuntimeError(f"run() needs a new worker (this one is {self._state})")
            self._state = "starting"
        self._started_at = time.time()
        try:
            self._setup()
            with self._state_lock:
                if self._state == "starting":
                    self._state = "running"
            self.log.info(
                "worker_started",
                topics=list(self.settings.input_topics),
                group=self.settings.group_id,
                delivery=self.settings.delivery,
                static=self.settings.static_membership,
            )
            self._loop_body()
        except BaseException as caught:
            # A batch the consumer cannot read is named (what and where), not a bare error.
            exc = unreadable_batch(caught, self._consumer) or caught
            self._last_error = f"{type(exc).__name__}: {exc}"
            self.log.error("worker_failed", error=self._last_error, exc_info=True)
            if exc is not caught:
                # What was read before that batch is finished and committed, as in a
                # drain: the group's offset stands at the batch (no work redone, ever).
                with contextlib.suppress(Exception):
                    self._finish_in_flight()
            self._teardown(failed=True)
            self._set_state("failed")
            self._finished.set()
            if exc is not caught:
                raise exc from caught
            if isinstance(exc, WorkerFailed):
                raise
            raise WorkerFailed(self._last_error) from exc
        self._teardown(failed=False)
        self._set_state("stopped")
        self._finished.set()
        self.log.info("worker_stopped", **self._summary)
        return self.status()

    def drain(self, timeout_s: float | None = None) -> dict[str, Any]:
        """Stop fetching, finish the batches in flight, commit, leave the group.

        Blocks until `run()` has returned (at most `timeout_s`, default the settings'
        drain timeout plus the client close bound); returns `status()`."""
        with self._state_lock:
            if self._state == "new":
                self._state = "stopped"
                self._finished.set()
                return self.status()
            if self._state in ("running", "starting"):
                self._state = "draining"
        self._drain.set()
        self._wake.set()
        limit = timeout_s if timeout_s is not None else self.settings.drain_timeout_s
        self._finished.wait(limit + _CLOSE_TIMEOUT_S)
        return self.status()

    def stop(self, timeout_s: float = _CLOSE_TIMEOUT_S * 2) -> dict[str, Any]:
        """Leave at once: batches in flight are abandoned (consumed again by the partitions'
        next owner); only acknowledged work is committed."""
        with self._state_lock:
            if self._state == "new":
                self._state = "stopped"
                self._finished.set()
                return self.status()
            if self._state not in ("stopped", "failed"):
                self._state = "stopping"
        self._stop.set()
        self._wake.set()
        self._finished.wait(timeout_s)
        return self.status()

    def status(self) -> dict[str, Any]:
        """Counters and state, safe to call from any thread."""
        snap = self.metrics.snapshot()
        committed = {tp_name(tp): off for tp, off in dict(self._offsets.committed).items()}
        return {
            "worker": self.name,
            "pipeline": self.settings.pipeline,
            "state": self._state,
            "delivery": self.settings.delivery,
            "assignment": sorted(tp_name(tp) for tp in self._assignment),
            "committed": committed,
            "uptime_s": round(time.time() - self._started_at, 3) if self._started_at else 0.0,
            "last_error": self._last_error,
            "group": self._membership(),
            "outage": self._outage.status(),
            "metrics_exported": self.metrics.exported,  # to Ray's metrics (under Ray)
            **snap,
        }

    def report(self) -> tuple[WorkerState, int, int, float]:
        """(state, answered, dead-lettered, engine seconds): what the controller reads."""
        m = self.metrics
        return self._state, m.answered, m.dead_lettered, m.engine_seconds

    def _membership(self) -> dict[str, Any]:
        """This member's generation and id as its consumer knows them (-1 and "" while it
        is out of the group)."""
        consumer = self._consumer
        if consumer is None:
            return {"generation": -1, "member_id": ""}
        try:
            meta = consumer.group_metadata()
        except Exception:
            return {"generation": -1, "member_id": ""}
        return {"generation": meta.generation_id, "member_id": meta.member_id}

    @property
    def state(self) -> WorkerState:
        return self._state

    def wait_finished(self, timeout_s: float | None = None) -> bool:
        return self._finished.wait(timeout_s)

    # ================================================================== setup / teardown

    def _set_state(self, state: WorkerState) -> None:
        with self._state_lock:
            self._state = state

    def _setup(self) -> None:
        s = self.settings
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(
            target=self._loop.run_forever, name=f"{self.name}-engine", daemon=True
        )
        self._loop_thread.start()
        # Build the engine on its own loop (an in-process vLLM binds to the loop it starts on).
        self._classifier = self._on_loop(self._build_classifier()).result()
        self._model = self._classifier.engine.info.model.encode()
        self._producer = self._make_producer()
        # Where outputs may go and how large they may be: asked on a connection of its own
        # (one request, answered at once, where the producer would wait for metadata).
        self._admin = KafkaAdminClient(**s.kafka.client_kwargs(client_id=f"{self._client}-admin"))
        self._topics = TopicGuard(s, admin_describe(self._admin))
        for topic in (s.output_topic, s.dead_letter_topic):
            self._topics.lookup(topic)  # their max.message.bytes (a failure keeps the default)
        # Calibration, audit, CloudEvents attributes and traces (workers.decisions).
        self._decisions = Decisions.build(
            s, self._classifier, tracer_provider=self._tracer_provider
        )
        self._builder = OutputBuilder(s, self._model, self._topics, self.log, self._decisions)
        self._consumer = self._make_consumer()
        self._make_committer()
        subscribe_known(self._consumer, s.input_topics, listener=_Listener(self))

    @property
    def _client(self) -> str:
        return f"{self.settings.kafka.client_id}-{self.name}"

    def _make_producer(self) -> Any:
        s = self.settings
        codec = s.producer.compression_type
        producer_kw: dict[str, Any] = {
            "acks": "all",
            "enable_idempotence": True,
            # The pipeline's topics are created with the deployment; a reply_topic that
            # does not exist is refused, not created (nor is a missing output topic).
            "allow_auto_create_topics": False,
            "linger_ms": s.producer.linger_ms,
            "max_block_ms": s.producer.max_block_ms,
            "delivery_timeout_ms": s.producer.delivery_timeout_ms,
            "max_request_size": s.producer.max_request_size,
            "request_timeout_ms": s.producer.request_timeout_ms,
            "compression_type": None if codec == "none" else codec,
        }
        if self._eos:
            producer_kw["transactional_id"] = s.transactional_id
            producer_kw["transaction_timeout_ms"] = s.producer.transaction_timeout_ms
        producer = KafkaProducer(
            **s.kafka.client_kwargs(client_id=f"{self._client}-producer"), **producer_kw
        )
        _no_auto_create(producer)
        return producer

    def _make_consumer(self) -> Any:
        s = self.settings
        consumer_kw: dict[str, Any] = {
            "group_id": s.group_id,
            "enable_auto_commit": False,
            "auto_offset_reset": s.consumer.auto_offset_reset,
            "isolation_level": s.consumer.isolation_level,
            "partition_assignment_strategy": [CooperativeStickyAssignor],
            "max_poll_records": s.batching.max_records,
            "session_timeout_ms": s.consumer.session_timeout_ms,
            "heartbeat_interval_ms": s.consumer.heartbeat_interval_ms,
            "max_poll_interval_ms": s.consumer.max_poll_interval_ms,
        }
        if s.static_membership:
            consumer_kw["group_instance_id"] = s.group_instance_id
        return KafkaConsumer(
            **s.kafka.client_kwargs(client_id=f"{self._client}-consumer"), **consumer_kw
        )

    def _make_committer(self) -> None:
        timeout = self.settings.commit_timeout_s
        if self._eos:
            # init_transactions fences an earlier producer of this replica (an earlier
            # incarnation, or this one's own before a reset) and aborts its transaction.
            self._txn = ExactlyOnceCommitter(
                self._producer, self._consumer, timeout, self._poison.progress
            )
            self._txn.start()
            self._committer = self._txn
        else:
            self._committer = AtLeastOnceCommitter(
                self._consumer, self.log, timeout, self._poison.progress
            )

    def _reset_producer(self, reason: str) -> None:
        """A new producer in place of one that kafka-python made unusable (its idempotent
        sender treats a record the broker refused for good as fatal). The open work is
        abandoned first; under exactly-once the new producer fences the old one."""
        with self._state_lock:
            self._apply_completions()
            self._abandon(f"producer reset: {reason}")
            self._producer_broken = False
            old = self._producer
            with contextlib.suppress(Exception):
                old.close(timeout=_CLOSE_TIMEOUT_S)
            self._producer = self._make_producer()
            self._make_committer()
        self.metrics.record_producer_reset()
        self.log.warning("producer_reset", reason=reason[:300])

    async def _build_classifier(self) -> Classifier:
        if self._classifier is not None:
            return self._classifier
        from workers.engine.factory import build_classifier

        return build_classifier(self.settings.engine, self.settings.question_sets, self.name)

    def _on_loop(self, coro: Any) -> ConcurrentFuture[Any]:
        assert self._loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def _teardown(self, *, failed: bool) -> None:
        """Close everything; never raises."""
        self._closing = True
        if failed or self._stop.is_set():
            # Nothing in flight may reach the output after this (exactly-once: the open
            # transaction is aborted rather than left to its timeout).
            with contextlib.suppress(Exception):
                self._abandon("stopping" if not failed else "failed")
        self._close_clients(failed)
        self._stop_engine_loop()
        if self._decisions is not None:
            with contextlib.suppress(Exception):
                self._decisions.close()  # flushes the spans still buffered
        self.metrics.set_in_flight(0)
        self._summary = {
            "consumed": self.metrics.consumed,
            "answered": self.metrics.answered,
            "dead_lettered": self.metrics.dead_lettered,
            "committed": {tp_name(tp): o for tp, o in sorted(self._offsets.committed.items())},
        }

    def _close_clients(self, failed: bool) -> None:
        if self._consumer is not None:
            try:
                self._consumer.close(autocommit=False, timeout_ms=int(_CLOSE_TIMEOUT_S * 1000))
            except Exception as exc:
                self.log.warning("consumer_close_failed", error=str(exc))
        drained = not failed and self._drain.is_set() and not self._stop.is_set()
        if drained and self.settings.static_membership:
            self._remove_static_member()
        if self._producer is not None:
            try:
                self._producer.close(timeout=_CLOSE_TIMEOUT_S)
            except Exception as exc:
                self.log.warning("producer_close_failed", error=str(exc))
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()

    def _stop_engine_loop(self) -> None:
        loop, thread = self._loop, self._loop_thread
        if loop is None or thread is None:
            return
        if self._classifier is not None:
            with contextlib.suppress(Exception):
                self._on_loop(self._classifier.engine.close()).result(_CLOSE_TIMEOUT_S)

        async def _cancel_rest() -> None:
            me = asyncio.current_task()
            for task in asyncio.all_tasks():
                if task is not me:
                    task.cancel()

        with contextlib.suppress(Exception):
            self._on_loop(_cancel_rest()).result(_CLOSE_TIMEOUT_S)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(_CLOSE_TIMEOUT_S)
        if not thread.is_alive():
            loop.close()

    def _remove_static_member(self) -> None:
        """A static member never sends LeaveGroup: ask the coordinator to remove it, so its
        partitions move now rather than after session_timeout_ms."""
        from kafka.admin import MemberToRemove

        try:
            with admin_client(self.settings.kafka) as admin:
                admin.remove_group_members(
                    self.settings.group_id,
                    [
                        MemberToRemove(
                            group_instance_id=self.settings.group_instance_id,
                            reason="dgstream drain",
                        )
                    ],
                )
        except Exception as exc:
            self.log.warning("static_member_removal_failed", error=str(exc))

    # ================================================================== consumer thread

    def _loop_body(self) -> None:
        while True:
            # 1. Settle: acknowledged batches -> contiguous prefixes -> commit; while a
            #    rejoin is pending only the first (see _REJOIN_POLL_MS).
            with self._state_lock:
                if self._rejoin_pending():
                    self._apply_completions()
                else:
                    self._settle(sync=True)
            # 2. Control.
            if self._control():
                return
            self._maybe_update_lag()
            # 3. Backpressure: every slot is taken (the batch being filled needs one), or
            #    an outage holds new work back until its next try.
            if self._offsets.in_flight >= self._slots() or self._outage.holding():
                self._wait_full()
                continue
            # 4. Poll.
            records = self._poll()
            with self._state_lock:
                self._assignment = set(self._consumer.assignment())
                records = self._apply_rewind(records)
                # 5. Parse into the batch being filled.
                if records:
                    self._take(records)
                # 6. Submit when full, when waited long enough, or when the engine is idle.
                self._maybe_submit()

    def _slots(self) -> int:
        """Batches allowed between poll and commit: one while a partition is suspect."""
        return 1 if self._poison.careful() else self.settings.batching.max_in_flight

    def _control(self) -> bool:
        """Step 2: whether to leave the loop (raises on a failure)."""
        if self._producer_broken and self._failure is None:
            self._reset_producer("an abort failed")
        if self._failure is not None:
            raise WorkerFailed(
                f"{type(self._failure).__name__}: {self._failure}"
            ) from self._failure
        if self._stop.is_set():
            return True
        if self._drain.is_set():
            self._finish_in_flight()
            return True
        return False

    def _poll(self) -> dict[TopicPartition, list[Any]]:
        """Step 4: up to `max_records - len(batch)` records; waits no longer than the batch
        being filled may still wait."""
        b = self.settings.batching
        acc = self._acc
        if acc is not None and len(acc):
            timeout_ms = max(0, int((acc.started + b.max_wait_ms / 1000 - time.monotonic()) * 1000))
        elif self._offsets.in_flight:
            timeout_ms = b.max_wait_ms
        else:
            timeout_ms = _IDLE_POLL_MS
        if self._rejoin_pending():
            timeout_ms = max(timeout_ms, _REJOIN_POLL_MS)
        room = (1 if self._poison.careful() else b.max_records) - (len(acc) if acc else 0)
        records: dict[TopicPartition, list[Any]] = self._consumer.poll(
            timeout_ms=timeout_ms, max_records=max(room, 1)
        )
        self._last_poll = time.monotonic()
        return records

    def _maybe_submit(self) -> None:
        """Step 6: the batch being filled goes to the engine when it is full, when it has
        waited `max_wait_ms`, or at once when the engine is idle."""
        acc, b = self._acc, self.settings.batching
        if acc is None or not len(acc):
            return
        if (
            len(acc) >= b.max_records
            or self._poison.careful()
            or time.monotonic() - acc.started >= b.max_wait_ms / 1000
            or self._submitted == self._classified
        ):
            self._submit(acc)

    def _rejoin_pending(self) -> bool:
        # kafka-python 3 drives JoinGroup/SyncGroup from poll() only; knowing that one is
        # due lets the loop poll long enough for it to finish inside one call.
        coordinator = getattr(self._consumer, "_coordinator", None)
        need = getattr(coordinator, "need_rejoin", None)
        if need is None:
            return False
        try:
            return bool(need())
        except Exception:
            return False

    def _wait_full(self) -> None:
        """Every slot taken (or an outage pausing): wait for a completion; keep the
        membership alive meanwhile.

        No pause()/resume(): kafka-python 3.0's fetcher parks the parsed records of a paused
        partition and gives them back only while no other partition's records are in line
        (`Fetcher.fetch_records` tests `_next_partition_records is None`, which a drained
        batch never resets), and a parked partition is not fetched again: it stalls for
        good. Instead the loop stops polling, and when it must poll (a rejoin is due, or a
        second has passed) it takes at most one record and seeks back to it."""
        self._wake.wait(_FULL_WAIT_S)
        self._wake.clear()
        rejoin = self._rejoin_pending()
        if not rejoin and time.monotonic() - self._last_poll < _FULL_POLL_EVERY_S:
            return
        consumer = self._consumer
        records = consumer.poll(timeout_ms=_REJOIN_POLL_MS if rejoin else 0, max_records=1)
        self._last_poll = time.monotonic()
        with self._state_lock:
            self._assignment = set(consumer.assignment())
            for tp, recs in (records or {}).items():
                if recs and tp in self._assignment:
                    consumer.seek(tp, recs[0].offset)

    def _take(self, records: dict[TopicPartition, list[Any]]) -> None:
        """Step 5: parse the polled records into the batch being filled. While a partition
        is suspect (`workers.poison`) the batch takes one record; the rest are sought
        back and polled again."""
        for tp, recs in records.items():
            if recs and not self._poison.known(tp):
                self._first_seen(tp, recs[0].offset)
        if self._acc is None:
            self._seq += 1
            self._acc = Batch(self._seq)
        acc = self._acc
        room = 1 - len(acc) if self._poison.careful() else sum(map(len, records.values()))
        n = 0
        for tp, recs in records.items():
            if recs:
                self._offsets.saw(tp, recs[0].offset)
            for rec in recs:
                if n >= room:
                    self._consumer.seek(tp, rec.offset)
                    break
                n += 1
                acc.add(self._entry(tp, rec))
        self.metrics.record_consumed(n)

    def _entry(self, tp: TopicPartition, rec: Any) -> Entry:
        entry = Entry(tp, rec.offset, rec.key, rec.value, rec.timestamp, list(rec.headers or ()))
        killed = self._poison.poison(tp, rec.offset)
        if killed is not None:
            entry.error = RequestError(
                code=ErrorCode.POISON,
                message=f"this record was running alone when {killed.alone} worker "
                "incarnations died (an engine crash on it, or the process killed); it is "
                "not tried again",
            )
            return entry
        # A body without an id (Jev's) is named after its record: its key, else its place.
        fallback = record_id(rec.key, tp.topic, tp.partition, rec.offset)
        entry.fallback_id = fallback.value
        # Framing (if any), then the JSON (a structured CloudEvent by its content type).
        parsed = self._inputs.parse(rec.value, fallback, _header(entry.headers, CONTENT_TYPE))
        if isinstance(parsed, RequestError):
            entry.error = parsed
        elif parsed.question_set is not None and parsed.question_set not in (
            self.settings.question_sets
        ):
            entry.error = RequestError(
                code=ErrorCode.UNKNOWN_QUESTION_SET,
                message=f"question_set: no question set named {parsed.question_set!r} "
                f"in pipeline {self.settings.pipeline!r}",
                field="question_set",
            )
        else:
            entry.request = parsed
        return entry

    def _first_seen(self, tp: TopicPartition, first: int) -> None:
        """The partition's first records this incarnation: count the attempt (committed
        before they run, in the committed offset's metadata)."""
        try:
            meta = self._consumer.committed(tp, metadata=True, timeout_ms=_OFFSET_FETCH_TIMEOUT_MS)
        except Exception as exc:
            self.log.warning("committed_offset_unknown", partition=tp_name(tp), error=str(exc))
            meta = None
        committed = None if meta is None else meta.offset
        text = None if meta is None else meta.metadata
        self._marks[tp] = self._poison.first_seen(tp, first, committed, text)
        if self._poison.suspect(tp):
            self.log.warning("partition_suspect", partition=tp_name(tp), offset=first, seen=text)

    def _submit(self, batch: Batch) -> None:
        """The batch goes to the engine, once the attempt counts it needs are committed."""
        marks, self._marks = self._marks, {}
        for e in batch.entries:
            mark = self._poison.before_alone(e.tp, e.offset)
            if mark is not None:
                marks[e.tp] = mark
        if marks:
            self._settle(sync=True, marks=marks)
            if self._acc is not batch or self._failure is not None:
                return  # abandoned meanwhile (a stale membership): read again
        self._acc = None
        self._offsets.track(batch)
        self._submitted += 1
        self.metrics.set_in_flight(self._offsets.in_flight)
        self._on_loop(self._process(batch))

    def _finish_in_flight(self) -> None:
        """drain(): submit what was polled, wait for everything in flight, commit."""
        with self._state_lock:
            if self._acc is not None and len(self._acc):
                self._submit(self._acc)
            self._acc = None
        deadline = time.monotonic() + self.settings.drain_timeout_s
        while self._offsets.in_flight and time.monotonic() < deadline:
            if self._failure is not None:
                raise WorkerFailed(f"{self._failure}") from self._failure
            self._wake.wait(_FULL_WAIT_S)
            self._wake.clear()
            with self._state_lock:
                self._settle(sync=True)
        with self._state_lock:
            self._settle(sync=True)
            left = self._offsets.in_flight
            if not left:
                # Leaving cleanly is no crash: undo the attempt counts of partitions
                # this incarnation made no progress on.
                marks = self._poison.write_back(set(self._assignment))
                if marks:
                    self._settle(sync=True, marks=marks)
            if left:
                # The next owner reads them again; nothing of theirs may reach the output
                # after this (exactly-once: no transaction left open until its timeout,
                # holding back every read_committed reader of the output partitions).
                self._abandon("drain timeout")
        if left:
            self.log.warning(
                "drain_timeout", abandoned_batches=left, seconds=self.settings.drain_timeout_s
            )

    # ------------------------------------------------------------------ settling

    def _apply_completions(self) -> None:
        """Mark the batches the engine loop finished as done; the first failure sticks."""
        while True:
            try:
                batch, exc = self._done_q.get_nowait()
            except queue.Empty:
                return
            if exc is not None and batch.cancelled and not isinstance(exc, FatalEngineError):
                continue  # abandoned already: read again
            if isinstance(exc, Outage):
                self._on_outage(exc)
            elif isinstance(exc, Redo):
                self._on_redo(exc)
            elif exc is not None:
                self._failure = self._failure or exc
            else:
                if self._txn is None:  # exactly-once: done once in the transaction commit
                    batch.done = True
                if self._outage.active:
                    self._end_outage()

    def _on_outage(self, outage: Outage) -> None:
        """A batch met an outage: abandon the open work (read again after the pause) or,
        past the budget, fail."""
        pause = self._outage.hit(outage)
        self.metrics.record_outage_try(outage.kind)
        if self._outage.exhausted():
            budget = self.settings.outage.budget_s
            # An outage is not the records' fault: this incarnation's attempts are not
            # counted (best effort: the commit may be out of reach too).
            self._abandon(str(outage))
            with contextlib.suppress(Exception):
                marks = self._poison.write_back(set(self._assignment))
                if marks and self._committer is not None:
                    self._committer.commit(dict, sync=True, marks=marks)
            self._failure = self._failure or WorkerFailed(
                f"{outage} for longer than the outage budget ({budget:g} s)"
            )
            return
        self.log.warning(
            "outage",
            kind=outage.kind,
            tries=self._outage.tries,
            pause_s=round(pause, 3),
            error=outage.message[:300],
        )
        self._abandon(str(outage))

    def _on_redo(self, redo: Redo) -> None:
        """The broker refused an output for good: read the open work again at once (the
        output check now knows why and dead-letters that record); a refusal that keeps
        coming back is handled as an outage (backoff, budget)."""
        self._redo_streak += 1
        if self._redo_streak > _REDO_LIMIT:
            self._on_outage(Outage("output", f"outputs keep failing: {redo}"[:500]))
            return
        self._abandon(str(redo))
        if self._txn is None:
            # kafka-python's idempotent producer makes a record refused for good fatal.
            self._producer_broken = True

    def _end_outage(self) -> None:
        kind, tries = self._outage.kind, self._outage.tries
        lasted = self._outage.clear()
        self.metrics.record_outage_over()
        self.log.info("outage_over", kind=kind, tries=tries, lasted_s=round(lasted, 3))

    def _settle(self, *, sync: bool, marks: Marks | None = None) -> None:
        """Step 1: apply completions, commit the contiguous done prefix of each partition
        (and `marks`, the poison guard's attempt counts, for partitions with none).

        `sync`: commit and wait (consumer thread); otherwise commit_async (the listener,
        which runs on the I/O thread and must not block on it)."""
        self._apply_completions()
        if self._failure is not None:
            return
        self._note_membership()
        assert self._committer is not None
        try:
            committed = self._committer.commit(self._offsets.ready, sync=sync, marks=marks)
        except OutputFailed as exc:
            # An output of the transaction failed (kafka-python says only that it is in
            # an error state): as that output's own error.
            cause, self._last_output_error = self._last_output_error or exc.cause, None
            outage = produce_outage(cause)
            if outage is not None:
                self._on_outage(outage)
            else:
                self._on_redo(Redo(f"{exc}: {type(cause).__name__}: {cause}"))
            return
        except CommitRefused as exc:
            self._abandon(str(exc))
            return
        for tp, (offset, _) in committed.items():
            self._poison.committed(tp, offset)
        if committed:
            self._redo_streak = 0
            self._offsets.retire(committed)
            self.metrics.set_in_flight(self._offsets.in_flight)

    def _note_membership(self) -> None:
        """Abandon the open work when the member id changed under it: the member was out of
        the group meanwhile, and another may have answered and committed those records.
        kafka-python does not always say so: a JoinGroup refused with UNKNOWN_MEMBER_ID
        rejoins under a new id with the partitions kept and no on_partitions_lost."""
        try:
            member = self._consumer.group_metadata().member_id
        except Exception:
            return
        if not member:
            return  # out of the group now: exactly-once refuses to commit meanwhile
        if self._member and member != self._member:
            self._abandon(f"member id changed from {self._member} to {member}")
        self._member = member

    def _maybe_update_lag(self) -> None:
        now = time.monotonic()
        if now - self._last_lag >= _LAG_EVERY_S:
            self._update_lag()
            self._last_lag = now

    def _update_lag(self) -> None:
        consumer = self._consumer
        lag: dict[str, int] = {}
        for tp in self._assignment:
            try:
                high = consumer.highwater(tp)
            except Exception:
                continue
            if high is None:
                continue
            base = self._offsets.lag_base(tp)
            if base is not None:
                lag[tp_name(tp)] = max(0, int(high) - int(base))
        self.metrics.set_lag(lag)

    # ------------------------------------------------------------------ rebalances

    def _on_assigned(self, assigned: set[TopicPartition]) -> None:
        self.log.info("partitions_assigned", partitions=sorted(tp_name(tp) for tp in assigned))

    def _on_revoked(self, revoked: set[TopicPartition], *, lost: bool) -> None:
        """Finish (bounded) and commit the revoked partitions' work, then forget them."""
        if not revoked:
            return
        names = sorted(tp_name(tp) for tp in revoked)
        with self._state_lock:
            if self._acc is not None:
                self._acc.drop(revoked)
            closing = self._closing or self._failure is not None
            if lost:
                self.metrics.record_lost(len(revoked))
            if lost and self._txn is not None and not closing:
                # This member was fenced: the group gave these partitions to another.
                # Their outputs in the open transaction (and those of batches still in
                # flight) must not be committed by this member's next commit.
                self._guard(lambda: self._abandon("partitions lost"))
            elif not lost and not closing:
                finished = self._await_batches(revoked)
                self._guard(lambda: self._settle(sync=False))
                if not finished and self._txn is not None:
                    # Their outputs would land in a later transaction without their
                    # offsets: abandon the open work (the kept partitions read it again).
                    self._guard(lambda: self._abandon("revoke timeout"))
            if not lost and not closing:
                marks = self._poison.write_back(revoked)
                if marks:
                    self._guard(lambda: self._settle(sync=False, marks=marks))
            self._poison.forget(revoked)
            # On the way out, status() keeps the last commits.
            abandoned = self._offsets.forget(revoked, keep_committed=self._closing)
            self.metrics.set_in_flight(self._offsets.in_flight)
        self.log.info(
            "partitions_lost" if lost else "partitions_revoked",
            partitions=names,
            abandoned_batches=abandoned,
        )

    def _guard(self, step: Any) -> None:
        """Run a commit step in the listener: a failure there fails the worker at its next
        loop (an exception would only reach kafka-python's poll())."""
        try:
            step()
        except Exception as exc:
            self._failure = self._failure or WorkerFailed(f"{type(exc).__name__}: {exc}")

    def _abandon(self, reason: str) -> None:
        """Give up everything between poll and commit and read it again from the committed
        offsets: the batches in flight are cancelled (they produce nothing more; exactly-
        once: the open transaction is aborted with them), the batch being filled is
        dropped, and each of their partitions still assigned is sought back. Runs on the
        consumer thread or in the listener, under the state lock."""
        with self._state_lock:
            batches = list(self._offsets.pending.values())
            tps = {tp for b in batches for tp in b.last}
            if self._acc is not None:
                tps |= set(self._acc.last)
            if not tps:
                return  # nothing polled is unfinished (the transaction holds nothing)
            for tp in tps:
                start = self._offsets.lag_base(tp)
                if start is not None:
                    self._rewind[tp] = min(start, self._rewind.get(tp, start))
            self._acc = None

            def cancel() -> None:
                for b in batches:
                    b.cancelled = True

            if self._txn is not None:
                try:
                    self._txn.abort(cancel)
                except Exception as exc:
                    cancel()
                    self.log.warning("abort_failed", error=f"{type(exc).__name__}: {exc}")
                    if fenced(self._producer):
                        # Another producer took this transactional id (a newer incarnation
                        # of this replica): a new producer here would fence it in turn.
                        self._failure = self._failure or WorkerFailed(
                            "fenced: another producer with this transactional id started"
                        )
                    else:
                        # The producer is unusable (kafka-python made it fatal): the loop
                        # replaces it before taking new work; the new one fences this
                        # one, which aborts its transaction on the broker.
                        self._producer_broken = True
                self.metrics.record_aborted()
            else:
                cancel()
            self._offsets.forget(tps, keep_committed=True)
            self.metrics.set_in_flight(self._offsets.in_flight)
        self.log.warning(
            "open_work_abandoned",
            reason=reason,
            batches=len(batches),
            partitions=sorted(tp_name(tp) for tp in tps),
        )

    def _apply_rewind(
        self, records: dict[TopicPartition, list[Any]]
    ) -> dict[TopicPartition, list[Any]]:
        """Seek the partitions whose work was abandoned back to the group's committed
        offset (another member may have moved it on), else to where the work started;
        what the last poll returned for them comes again."""
        if not self._rewind:
            return records
        consumer, assigned = self._consumer, self._assignment
        for tp, fallback in list(self._rewind.items()):
            records.pop(tp, None)
            if tp in assigned:
                try:
                    committed = consumer.committed(tp, timeout_ms=_OFFSET_FETCH_TIMEOUT_MS)
                except KafkaError as exc:
                    # Unknown for now: the partition's records wait (dropped from this
                    # poll), and the next pass asks again; a guess could read past work
                    # that another member committed meanwhile.
                    self.log.warning("rewind_deferred", partition=tp_name(tp), error=str(exc))
                    continue
                consumer.seek(tp, fallback if committed is None else committed)
            del self._rewind[tp]
        return records

    def _await_batches(self, tps: set[TopicPartition]) -> bool:
        """Wait until every batch holding records of `tps` is done (acknowledged, or in the
        open transaction), within the revoke timeout and half the session timeout (this
        runs on the consumer's I/O thread, which also sends the heartbeats). Returns whether
        they all finished."""
        c = self.settings.consumer
        limit = min(c.revoke_timeout_s, c.session_timeout_ms / 2000)
        deadline = time.monotonic() + limit
        while True:
            self._apply_completions()
            if self._failure is not None:
                return False
            in_txn = self._txn.in_transaction() if self._txn is not None else set()
            waiting = [b for b in self._offsets.batches(tps) if not b.done and id(b) not in in_txn]
            if not waiting:
                return True
            if time.monotonic() >= deadline:
                self.log.warning("revoke_timeout", batches=len(waiting), seconds=limit)
                return False
            self._wake.wait(0.01)
            self._wake.clear()

    # ================================================================== engine loop

    async def _process(self, batch: Batch) -> None:
        """Steps 7-9 for one batch; reports completion (or failure) to the consumer thread."""
        prev, mine = self._send_turn, asyncio.Event()
        self._send_turn = mine
        classified = False
        try:
            requests = [e.request for e in batch.entries if e.request is not None]
            t0 = time.perf_counter()
            assert self._classifier is not None
            s = self.settings
            assert self._decisions is not None
            batch.trace = self._decisions.trace_batch(batch)  # None: tracing is off
            step = BatchClassifier(
                self._classifier,
                s.engine_retries,
                s.engine_retry_backoff_s,
                self.log,
                trace_ids=_trace_ids(batch, self._decisions),
            )
            try:
                outcomes = await step.classify(requests) if requests else []
            finally:
                self._classified += 1
                classified = True
                if batch.trace is not None:
                    batch.trace.finish("engine read")
            self.metrics.record_batch(len(batch))
            if requests:
                self.metrics.record_engine(time.perf_counter() - t0, step.calls)
            assert self._builder is not None
            outputs = await self._builder.build(batch, outcomes)
            if prev is not None:
                await prev.wait()
            if batch.trace is not None:
                batch.trace.begin("send", {"dgstream.outputs": len(outputs)})
            self._produce(batch, outputs)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            if not classified:
                self._classified += 1
            self._report(batch, produce_outage(exc) or exc)
        finally:
            mine.set()  # the next batch's outputs may go (a failed one sends nothing more)

    def _produce(self, batch: Batch, outputs: list[Output]) -> None:
        """Step 9: send; the batch is done when every output is acknowledged (exactly-
        once: when they are in the open transaction)."""
        if batch.cancelled:  # abandoned meanwhile: its records are read again
            Decisions.end_trace(batch)
            return
        if self._debug:
            for i, o in enumerate(outputs):
                if o.dead_code is None and o.key is not None:
                    rid = o.key.decode("utf-8", "backslashreplace")  # the input's key: any bytes
                    trace_id = Decisions.trace_id(o.entry, i, batch.trace)
                    self.log.debug("answered", key=rid, topic=o.topic, trace_id=trace_id)
        if self._txn is not None:
            self._produce_in_transaction(batch, outputs)
            return
        if not outputs:
            Decisions.end_trace(batch)
            self._done_q.put((batch, None))
            self._wake.set()
            return
        batch.waiting = len(outputs)

        def on_ack(_: Any) -> None:
            with batch.lock:
                batch.waiting -= 1
                finished = batch.waiting == 0 and not batch.reported
                if finished:
                    batch.reported = True
            if finished:
                Decisions.end_trace(batch)
                self._done_q.put((batch, None))
                self._wake.set()

        for o in outputs:
            fut = self._producer.send(o.topic, value=o.value, key=o.key, headers=o.headers)
            fut.add_callback(on_ack)
            fut.add_errback(functools.partial(self._output_failed, batch, o))
        self._record_outputs(outputs)

    def _produce_in_transaction(self, batch: Batch, outputs: list[Output]) -> None:
        assert self._txn is not None
        try:
            futures = self._txn.send(batch, outputs)
        except KafkaError as exc:
            # Once an output of the open transaction failed, kafka-python refuses every
            # later send until the transaction is aborted: as that output's own error
            # (an outage, or a refusal), which aborts and reads the open work again.
            cause = self._last_output_error or exc
            self._report(batch, produce_outage(cause) or Redo(f"{type(cause).__name__}: {cause}"))
            return
        if futures is None:
            return  # cancelled
        for o, fut in zip(outputs, futures, strict=True):
            fut.add_errback(functools.partial(self._output_failed, batch, o))
        self._record_outputs(outputs)
        Decisions.end_trace(batch)
        self._done_q.put((batch, None))  # in the transaction (an outage is over)
        self._wake.set()

    def _record_outputs(self, outputs: list[Output]) -> None:
        now_ms = time.time() * 1000
        e2e = [(now_ms - o.entry.timestamp_ms) / 1000 for o in outputs if o.entry.timestamp_ms > 0]
        dead = [o.dead_code for o in outputs if o.dead_code is not None]
        self.metrics.record_outputs(len(outputs) - len(dead), dead, e2e)
        self.metrics.record_routes([o.route for o in outputs if o.route])

    def _output_failed(self, batch: Batch, output: Output, exc: BaseException) -> None:
        """The broker refused an output (producer I/O thread). What was known of its topic
        (limit, ACLs) is asked again; waiting may cure some errors (an outage); for the
        rest the batch is read again, and the output check refuses the record that does
        not fit (kafka-python fails every batch in flight with the refused one's error,
        so the error alone does not say which record it was)."""
        self._last_output_error = exc
        if self._topics is not None:
            self._topics.forget(output.topic)
        failed = f"an output to {output.topic!r} failed: {exc}"
        self._report(batch, produce_outage(exc) or Redo(failed))
        if self._txn is None:
            # kafka-python's idempotent sender may have gone fatal with this batch (it does
            # for a record refused for good): the loop puts a new producer in first.
            self._producer_broken = True

    def _report(self, batch: Batch, exc: BaseException) -> None:
        with batch.lock:
            if batch.reported:
                return
            batch.reported = True
        Decisions.end_trace(batch, exc)
        if batch.cancelled and not isinstance(exc, FatalEngineError):
            return  # abandoned already: its records are read again
        self._last_error = f"{type(exc).__name__}: {exc}"
        self._done_q.put((batch, exc))
        self._wake.set()


def _header(headers: list[tuple[str, bytes | None]], name: str) -> str | None:
    """A record header's value as text (the first of that name, compared ignoring case)."""
    for key, value in headers:
        if key.lower() == name and value:
            return bytes(value).decode("utf-8", "replace")
    return None


def _trace_ids(batch: Batch, decisions: Decisions) -> dict[str, str]:
    """Request id -> trace id, for the engine stage's log lines about a request."""
    out = {}
    for i, e in enumerate(batch.entries):
        if e.request is not None:
            tid = decisions.trace_id(e, i, batch.trace)
            if tid is not None:
                out[e.request.id] = tid
    return out

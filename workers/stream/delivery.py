"""Delivery: the producer, sending a batch's outputs, and committing their offsets, in two
halves. At-least-once: a batch is done when the broker acknowledged every output, and its
offsets are committed through the consumer afterwards. Exactly-once: outputs go into the
open transaction, which commits them with their offsets; work that cannot be committed is
aborted with it. `delivery_for` is the one place that chooses between them: nothing else
in the worker asks which guarantee it runs under.

Threads, by method: `send` runs on the engine loop; the send callbacks on the producer's
I/O thread (they only hand the batch to the completion queue); `delivered`, `abort`,
`commit` and `renew` on the consumer thread, or in the rebalance listener while the
consumer thread waits inside poll() (under the shared lock).
"""

from __future__ import annotations

import contextlib
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

from kafka import KafkaProducer
from kafka.errors import KafkaError

from dgstream.workers.commit import (
    AtLeastOnceCommitter,
    Committer,
    ExactlyOnceCommitter,
    Marks,
    Ready,
)
from dgstream.workers.faults.errors import OutputFailed, SendFailed, WorkerFailed
from dgstream.workers.kafka.quirks import fenced, no_auto_create
from dgstream.workers.results.decisions import Decisions, RecordContext
from dgstream.workers.steps.batches import Batch, Output
from dgstream.workers.steps.topics import TopicGuard
from dgstream.workers.stream.shared import CLOSE_TIMEOUT_S, Completions, Shared

__all__ = ["AtLeastOnce", "Delivery", "ExactlyOnce", "delivery_for"]


class Delivery(ABC):
    """What both halves share: the producer, the outputs' bookkeeping, a failed send."""

    must_abandon_unfinished: ClassVar[bool] = False

    def __init__(
        self, shared: Shared, completions: Completions, topics: TopicGuard, client_id: str
    ) -> None:
        self._s = shared
        self._completions = completions
        self._topics = topics
        self._client_id = client_id
        self._debug = shared.settings.log_level == "DEBUG"  # per-request "answered" events
        self.producer: Any = None
        self.committer: Committer | None = None
        self._consumer: Any = None  # the committer's (a renewed one gets it too)
        self.broken = False  # the producer is unusable: replace it before new work
        # The last error an output met (producer I/O thread): what an exactly-once commit
        # that failed with kafka-python's generic "error state" was about.
        self._last_output_error: BaseException | None = None

    # ------------------------------------------------------------------ the clients

    def open_producer(self) -> None:
        s = self._s.settings
        codec = s.producer.compression_type
        options: dict[str, Any] = {
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
            **self._producer_options(),
        }
        self.producer = KafkaProducer(
            **s.kafka.client_kwargs(client_id=f"{self._client_id}-producer"), **options
        )
        no_auto_create(self.producer)

    def open_committer(self, consumer: Any) -> None:
        self._consumer = consumer
        self.committer = self._committer_for(consumer)

    def renew(self) -> None:
        """A new producer (and committer) in place of one that kafka-python made unusable;
        the caller abandoned the open work first."""
        self.broken = False
        with contextlib.suppress(Exception):
            self.producer.close(timeout=CLOSE_TIMEOUT_S)
        self.open_producer()
        self.open_committer(self._consumer)

    def close(self) -> None:
        if self.producer is None:
            return
        try:
            self.producer.close(timeout=CLOSE_TIMEOUT_S)
        except Exception as exc:
            self._s.log.warning("producer_close_failed", error=str(exc))

    def commit(
        self, ready: Callable[[], Ready], *, sync: bool, marks: Marks | None = None
    ) -> Ready:
        assert self.committer is not None
        return self.committer.commit(ready, sync=sync, marks=marks)

    # ------------------------------------------------------------------ the halves' hooks

    def _producer_options(self) -> dict[str, Any]:
        return {}

    @abstractmethod
    def _committer_for(self, consumer: Any) -> Committer: ...

    @abstractmethod
    def send(self, batch: Batch, outputs: list[Output]) -> None:
        """A batch's outputs to the broker (engine loop); the batch ends in the completion
        queue."""

    @abstractmethod
    def delivered(self, batch: Batch) -> None:
        """A completion without error reached the consumer thread."""

    @abstractmethod
    def in_transaction(self) -> set[int]:
        """ids of the batches whose outputs are in the open transaction."""

    @abstractmethod
    def abort(self, cancel: Callable[[], None]) -> None:
        """Cancel the open work (`cancel()`), and what was sent of it where it can be."""

    @abstractmethod
    def after_failed_send(self) -> None:
        """A send failed, or a batch is read again because one did."""

    # ------------------------------------------------------------------ shared by both

    def _answered(self, batch: Batch, outputs: list[Output]) -> None:
        if self._debug:
            for i, o in enumerate(outputs):
                if o.dead_code is None and o.key is not None:
                    rid = o.key.decode("utf-8", "backslashreplace")  # the input's key: any bytes
                    trace_id = RecordContext(o.entry, i, batch.trace).trace_id
                    self._s.log.debug("answered", key=rid, topic=o.topic, trace_id=trace_id)

    def _watch(self, batch: Batch, outputs: list[Output], futures: list[Any]) -> None:
        """Each send's failure goes to the completion queue; the outputs are counted."""
        for o, fut in zip(outputs, futures, strict=True):
            fut.add_errback(functools.partial(self._failed, batch, o))
        now_ms = time.time() * 1000
        e2e = [(now_ms - o.entry.timestamp_ms) / 1000 for o in outputs if o.entry.timestamp_ms > 0]
        dead = [o.dead_code for o in outputs if o.dead_code is not None]
        metrics = self._s.metrics
        metrics.record_outputs(len(outputs) - len(dead), dead, e2e)
        metrics.record_routes([o.route for o in outputs if o.route])

    def _failed(self, batch: Batch, output: Output, exc: BaseException) -> None:
        """The broker refused an output (producer I/O thread). What was known of its topic
        (limit, ACLs) is asked again; the error table decides the rest (kafka-python fails
        every batch in flight with the refused one's error, so the error alone does not
        say which record it was: the output check finds it when the batch is read again)."""
        self._last_output_error = exc
        self._topics.forget(output.topic)
        self._completions.failed(batch, SendFailed(exc, f"an output to {output.topic!r} failed"))
        self.after_failed_send()


class AtLeastOnce(Delivery):
    """Offsets committed through the consumer once every output of their batches is
    acknowledged (`acks=all`, the idempotent producer)."""

    def _committer_for(self, consumer: Any) -> Committer:
        timeout = self._s.settings.commit_timeout_s
        return AtLeastOnceCommitter(consumer, self._s.log, timeout, self._s.poison.progress)

    def send(self, batch: Batch, outputs: list[Output]) -> None:
        """The batch is done when every output is acknowledged (engine loop)."""
        if batch.cancelled:  # abandoned meanwhile: its records are read again
            Decisions.end_trace(batch)
            return
        self._answered(batch, outputs)
        if not outputs:
            Decisions.end_trace(batch)
            self._completions.done(batch)
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
                self._completions.done(batch)

        futures = []
        try:
            for o in outputs:
                fut = self.producer.send(o.topic, value=o.value, key=o.key, headers=o.headers)
                fut.add_callback(on_ack)
                futures.append(fut)
        except KafkaError as exc:
            # kafka-python refused to take an output at all (its metadata not had in
            # max_block_ms, a sender gone fatal): the batch fails as a refused send does,
            # rather than the engine loop, and is read again.
            self._watch(batch, outputs[: len(futures)], futures)
            self._failed(batch, outputs[len(futures)], exc)
            return
        self._watch(batch, outputs, futures)

    def delivered(self, batch: Batch) -> None:
        batch.done = True  # every output acknowledged: its offsets may be committed

    def in_transaction(self) -> set[int]:
        return set()  # no transaction: a batch is done when acknowledged

    def abort(self, cancel: Callable[[], None]) -> None:
        cancel()  # what was sent stays sent: the records are read again (at least once)

    def after_failed_send(self) -> None:
        # kafka-python's idempotent sender may have gone fatal with this batch (it does
        # for a record refused for good): the loop puts a new producer in first.
        self.broken = True


class ExactlyOnce(Delivery):
    """Outputs and offsets in one transaction of the replica's transactional producer."""

    must_abandon_unfinished = True  # its outputs would commit later without its offsets
    _txn: ExactlyOnceCommitter  # the committer (`open_committer`)

    def _producer_options(self) -> dict[str, Any]:
        s = self._s.settings
        return {
            "transactional_id": s.transactional_id,
            "transaction_timeout_ms": s.producer.transaction_timeout_ms,
        }

    def _committer_for(self, consumer: Any) -> Committer:
        # init_transactions fences an earlier producer of this replica (an earlier
        # incarnation, or this one's own before a reset) and aborts its transaction.
        timeout = self._s.settings.commit_timeout_s
        txn = ExactlyOnceCommitter(self.producer, consumer, timeout, self._s.poison.progress)
        txn.start()
        self._txn = txn
        return txn

    def send(self, batch: Batch, outputs: list[Output]) -> None:
        """The batch is done once its outputs are in the open transaction (engine loop)."""
        if batch.cancelled:
            Decisions.end_trace(batch)
            return
        self._answered(batch, outputs)
        try:
            futures = self._txn.send(batch, outputs)
        except KafkaError as exc:
            # Once an output of the open transaction failed, kafka-python refuses every
            # later send until the transaction is aborted: as that output's own error.
            cause = self._last_output_error or exc
            self._completions.failed(batch, SendFailed(cause, "a send into the transaction"))
            return
        if futures is None:
            return  # cancelled
        self._watch(batch, outputs, futures)
        Decisions.end_trace(batch)
        self._completions.done(batch)  # in the transaction (an outage is over)

    def delivered(self, batch: Batch) -> None:
        pass  # done when the transaction holding its outputs commits (with its offsets)

    def in_transaction(self) -> set[int]:
        return self._txn.in_transaction()

    def after_failed_send(self) -> None:
        pass  # the transaction is aborted with the open work, which makes the producer usable

    def abort(self, cancel: Callable[[], None]) -> None:
        """Cancel the batches in flight and abort the open transaction with them. Raises
        WorkerFailed when the producer was fenced; an abort that failed otherwise leaves
        the producer unusable (`broken`): the new one fences it, which aborts its
        transaction on the broker."""
        try:
            self._txn.abort(cancel)
        except Exception as exc:
            cancel()
            self._s.log.warning("abort_failed", error=f"{type(exc).__name__}: {exc}")
            if fenced(self.producer):
                # Another producer took this transactional id (a newer incarnation of this
                # replica): a new producer here would fence it in turn.
                self._s.metrics.record_aborted()
                raise WorkerFailed(
                    "fenced: another producer with this transactional id started"
                ) from exc
            self.broken = True
        self._s.metrics.record_aborted()

    def commit(
        self, ready: Callable[[], Ready], *, sync: bool, marks: Marks | None = None
    ) -> Ready:
        try:
            return super().commit(ready, sync=sync, marks=marks)
        except OutputFailed as exc:
            # kafka-python says only that the transaction is in an error state: the error
            # is that of the output that failed, when one was seen.
            cause, self._last_output_error = self._last_output_error or exc.cause, None
            raise OutputFailed(cause) from exc


def delivery_for(
    shared: Shared, completions: Completions, topics: TopicGuard, client_id: str
) -> Delivery:
    """The half the settings ask for: the one place that branches on the guarantee."""
    half = ExactlyOnce if shared.settings.delivery == "exactly_once" else AtLeastOnce
    return half(shared, completions, topics, client_id)

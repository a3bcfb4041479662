"""Rebalances while every batch slot is taken: a member joins or leaves mid-batch, on an
8-partition topic, with a slow engine, in both delivery modes; a drain that starts while
the group is rebalancing; and the kafka-python behaviour underneath.

Seen on 2026-12-07 against `dgstream run`: a worker whose slots were all taken stopped
making progress for good; every offset commit failed with RebalanceInProgressError ("You
can try completing the rebalance by calling poll()"), thousands a minute, and its drain
timed out and abandoned its batches. kafka-python 3.0 takes a join's result only inside a
poll() that waits on it: a member that does not poll, or polls briefly, while its join
finishes keeps sending new JoinGroups (a new rebalance each, from the leader) and stays
REBALANCING, refusing every commit on the client side. The worker now polls (with its
partitions paused) whenever it waits, also while draining, and keeps a join that finished
between polls (`workers.kafka.quirks.keep_finished_joins`)."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from bench.harness.faults import DELIVERIES, LogTap, SlowEngine, classifier_with
from bench.harness.pipeline import Pipeline, WorkerThread, count_duplicates
from bench.harness.waiting import wait_for

pytestmark = [pytest.mark.broker, pytest.mark.slow]

PARTITIONS = 8
REQUESTS = 480
# Each engine read takes this long: a batch of 8 records spends ~0.3 s in the engine, so
# with 2 batches in flight the slots stay taken for the whole run (the consumer thread
# is in its backpressure wait while the rebalance happens).
_READ_S = 0.3


class Tap(LogTap):
    """A LogTap that also keeps each event's fields (what an assertion shows)."""

    def __init__(self, worker: Any) -> None:
        super().__init__(worker)
        self.fields: list[tuple[str, dict[str, Any]]] = []

    def _emit(self, level: str, event: str, **kw: Any) -> None:
        self.fields.append((event, kw))
        super()._emit(level, event, **kw)

    def named(self, event: str) -> list[dict[str, Any]]:
        return [kw for e, kw in self.fields if e == event]


def _worker(p: Pipeline, delivery: str, replica: int) -> WorkerThread:
    settings = p.settings(
        delivery=delivery,
        replica=replica,
        batching={"max_records": 8, "max_wait_ms": 20, "max_in_flight": 2},
    )
    classifier, _ = classifier_with(lambda inner: SlowEngine(inner, _READ_S), settings)
    return WorkerThread(settings, classifier=classifier)


def _answered(p: Pipeline, delivery: str) -> Any:
    return p.reader(read_committed=delivery == "exactly_once")


def _commit_failures(tap: LogTap) -> int:
    return tap.events.count("commit_failed")


@pytest.mark.parametrize("delivery", DELIVERIES)
@pytest.mark.parametrize("change", ["join", "leave"])
def test_a_member_joins_or_leaves_while_every_slot_is_taken(
    kafka_connection: Any,
    unique_name: Any,
    worker_threads: list[WorkerThread],
    delivery: str,
    change: str,
) -> None:

    p = Pipeline.create(kafka_connection, unique_name, PARTITIONS)
    ids = p.produce_requests(REQUESTS)

    first = _worker(p, delivery, 0)
    taps = [LogTap(first.worker)]
    worker_threads.append(first.start())
    second = _worker(p, delivery, 1)
    taps.append(LogTap(second.worker))
    if change == "leave":
        # Both own partitions first; then one leaves while the other's slots are taken.
        worker_threads.append(second.start())
    reader = _answered(p, delivery)
    # Mid-run: some answers are out, the slots are taken.
    reader.read_until(lambda r: len(r.records) >= REQUESTS // 8, 120, "the first answers")
    if change == "join":
        worker_threads.append(second.start())
    else:
        wait_for(lambda: second.worker.status()["assignment"], 60, "the second member's share")
        second.worker.drain()
        second.join(90)

    def all_answered(r: Any) -> bool:
        return {json.loads(rec.value)["id"] for rec in r.records} >= set(ids)

    reader.read_until(all_answered, 240, "every request answered after the rebalance")
    for t in (first, second):
        assert t.error is None, t.error
    keys = [rec.key.decode() for rec in reader.records]
    if delivery == "exactly_once":
        assert count_duplicates(keys) == 0
    # Commits refused during a rebalance are retried on the next pass: a handful, never a
    # storm of them (the deadlock failed thousands a minute).
    assert sum(_commit_failures(t) for t in taps) < 50
    # The group settles: the lag drains to zero.
    wait_for(lambda: p.lag() == 0, 60, "the group's lag to drain")


# --------------------------------------------------------------------------- a drain


def _member(p: Pipeline, name: str, **overrides: Any) -> Any:
    from kafka import KafkaConsumer
    from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor

    from dgstream.workers.kafka.admin import subscribe_known

    options: dict[str, Any] = {
        "group_id": p.group,
        "enable_auto_commit": False,
        "partition_assignment_strategy": [CooperativeStickyAssignor],
        "session_timeout_ms": 6000,
        "heartbeat_interval_ms": 1000,
        **overrides,
    }
    consumer = KafkaConsumer(**p.conn.client_kwargs(client_id=name), **options)
    subscribe_known(consumer, [p.input])
    return consumer


class _Polling:
    """A plain member of the group that polls on a thread of its own until closed."""

    def __init__(self, consumer: Any) -> None:
        self.consumer = consumer
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.consumer.poll(timeout_ms=200)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.consumer.close(autocommit=False)


# The frozen member's rebalance timeout: the group waits this long for it to rejoin while
# it heartbeats without polling (then kafka-python makes it leave). Meanwhile the worker's
# JoinGroup is held: it is REBALANCING when its drain starts.
_FROZEN_POLL_INTERVAL_MS = 10_000


@pytest.fixture
def closing() -> Iterator[list[Any]]:
    """Plain members and pollers a test opened, closed at its end."""
    opened: list[Any] = []
    yield opened
    for thing in reversed(opened):
        thing.close()


@pytest.mark.parametrize("delivery", DELIVERIES)
def test_a_drain_that_starts_during_a_rebalance_finishes_it_and_commits(
    kafka_connection: Any,
    unique_name: Any,
    worker_threads: list[WorkerThread],
    closing: list[Any],
    delivery: str,
) -> None:
    """The worker's join waits on a frozen member when its drain starts. The drain must
    keep polling: once the frozen member is gone the join completes, the batches in
    flight are committed, and the worker leaves. Before the fix the drain polled nothing:
    the join finished unseen, every commit was refused as RebalanceInProgressError, and
    the drain timed out and abandoned its batches (read and answered again later)."""
    from dgstream.workers.kafka.quirks import rejoin_pending

    p = Pipeline.create(kafka_connection, unique_name, PARTITIONS)
    p.produce_requests(REQUESTS)
    settings = p.settings(
        delivery=delivery,
        drain_timeout_s=40,
        batching={"max_records": 8, "max_wait_ms": 20, "max_in_flight": 2},
    )
    classifier, _ = classifier_with(lambda inner: SlowEngine(inner, _READ_S), settings)
    w = WorkerThread(settings, classifier=classifier)
    tap = Tap(w.worker)
    worker_threads.append(w.start())
    reader = _answered(p, delivery)
    reader.read_until(lambda r: len(r.records) >= 16, 120, "the first answers")

    # A second member takes its share, then freezes: its I/O thread still heartbeats.
    frozen = _member(p, "frozen", max_poll_interval_ms=_FROZEN_POLL_INTERVAL_MS)
    closing.append(frozen)

    def shared() -> bool:
        frozen.poll(timeout_ms=200)
        return bool(frozen.assignment()) and len(w.worker.status()["assignment"]) < PARTITIONS

    wait_for(shared, 90, "the frozen member's share", every_s=0.1)
    # A third joins: the group waits for the frozen member to rejoin, the worker with it.
    closing.append(_Polling(_member(p, "joiner")))
    consumer = w.worker._consumer
    wait_for(lambda: rejoin_pending(consumer), 30, "the worker to be rejoining")

    started = time.monotonic()
    w.worker.drain()
    w.join(90)
    took = time.monotonic() - started
    assert w.error is None, w.error
    events = tap.events
    assert "drain_timeout" not in events, (took, events.count("commit_failed"))
    # (Exactly-once aborts the open transaction when a revocation takes a partition it
    # holds work of: that work is redone, once. A drain never gives up on its own.)
    reasons = [kw["reason"] for kw in tap.named("open_work_abandoned")]
    assert "drain timeout" not in reasons, reasons
    # It left once the frozen member was gone (its rebalance timeout), not at the drain's
    # own timeout.
    assert took < settings.drain_timeout_s, took

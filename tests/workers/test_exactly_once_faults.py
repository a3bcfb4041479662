"""Exactly-once under rebalances and zombies, on the real broker: a member kicked out of
its group (as a session expiry does) with batches in flight, a zombie's transactional
offset commit after its generation was reset, a drain that times out, a revocation that
times out, and two deployments of one pipeline. Every check reads the output with
read_committed: each id exactly once."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from bench.harness.faults import (
    GateEngine,
    LogTap,
    classifier_with,
    kick_member,
    kick_worker,
    member_ids,
)
from bench.harness.faults import transaction_state as txn_state
from bench.harness.pipeline import Pipeline, WorkerThread, count_duplicates
from bench.harness.waiting import wait_for

pytestmark = pytest.mark.broker

_SMALL = {"max_records": 8, "max_wait_ms": 20}


def _exactly_once(reader: Any, ids: list[str], pipeline: Pipeline) -> None:
    reader.read_until(lambda r: set(r.keys()) >= set(ids), 90, "every result")
    wait_for(lambda: pipeline.lag() == 0, 60, "the group's lag to reach 0")
    reader.read_to_end()
    keys = reader.keys()
    print(f"\n{len(keys)} results, {count_duplicates(keys)} duplicates")
    assert sorted(keys) == sorted(ids)


def test_partitions_lost_with_batches_in_flight_are_not_committed_by_the_next_commit(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """The member is kicked out while its engine holds two batches; it rejoins and reads
    its partitions again from the committed offsets. The held batches' outputs must not go
    into a transaction (they would be committed without their offsets, then answered
    again)."""
    settings = pipeline.settings(delivery="exactly_once", batching=_SMALL)
    classifier, engine = classifier_with(GateEngine, settings)
    ids = pipeline.produce_requests(40)
    wt = WorkerThread(settings, classifier=classifier).start()
    worker_threads.append(wt)
    assert engine.entered.wait(60), "no batch reached the engine"
    old = kick_worker(pipeline.conn, pipeline.group, wt.worker)
    wait_for(lambda: member_ids(pipeline.conn, pipeline.group) - {old}, 60, "the worker to rejoin")
    engine.gate.set()
    _exactly_once(pipeline.reader(read_committed=True), ids, pipeline)
    status = wt.worker.status()
    assert status["state"] == "running" and wt.error is None
    # kafka-python reports the loss (on_partitions_lost), or rejoins under a new member id
    # without a word (a JoinGroup refused with UNKNOWN_MEMBER_ID): aborted either way.
    assert status["transactions_aborted"] >= 1
    wt.worker.drain()
    wt.join()


def _member_and_producer(
    pipeline: Pipeline, name: str, session_ms: int, heartbeat_ms: int
) -> tuple[Any, Any]:
    """A plain group member of the pipeline's group (not yet subscribed) and a
    transactional producer with the id "<group>-<name>": a committer's two clients."""
    from kafka import KafkaConsumer, KafkaProducer

    consumer = KafkaConsumer(
        **pipeline.conn.client_kwargs(client_id=name),
        group_id=pipeline.group,
        enable_auto_commit=False,
        session_timeout_ms=session_ms,
        heartbeat_interval_ms=heartbeat_ms,
    )
    producer = KafkaProducer(
        **pipeline.conn.client_kwargs(client_id=f"{name}-p"),
        transactional_id=f"{pipeline.group}-{name}",
        enable_idempotence=True,
        acks="all",
    )
    return consumer, producer


def test_a_zombie_commits_no_offsets_after_its_generation_was_reset(
    pipeline: Pipeline,
) -> None:
    """kafka-python resets a kicked member's generation to -1 and its member id to "" on
    the heartbeat that learns of it; the coordinator checks a transactional offset commit
    carrying those against nothing. The committer must refuse it."""
    from kafka import TopicPartition

    from dgstream.workers.commit import ExactlyOnceCommitter, OffsetTracker
    from dgstream.workers.faults.errors import CommitRefused
    from dgstream.workers.kafka.admin import subscribe_known
    from dgstream.workers.steps.batches import Batch, Entry, Output

    conn = pipeline.conn
    # The transactional id is "<group>-zombie": the check below reads its state.
    consumer, producer = _member_and_producer(pipeline, "zombie", 6000, 500)
    try:
        subscribe_known(consumer, [pipeline.input])
        wait_for(lambda: consumer.poll(100) is not None and consumer.assignment(), 60, "joined")
        committer = ExactlyOnceCommitter(producer, consumer, timeout_s=30)
        committer.start()
        tp = TopicPartition(pipeline.input, 0)
        batch, tracker = Batch(1), OffsetTracker()
        batch.add(Entry(tp, 0, None, b"{}", 0))
        tracker.track(batch)
        committer.send(batch, [Output(pipeline.output, b"k", b"v", [], batch.entries[0], None)])
        member = consumer.group_metadata().member_id
        kick_member(conn, pipeline.group, member)
        # The heartbeat thread learns of it (no poll() here: that would rejoin).
        wait_for(lambda: consumer.group_metadata().generation_id < 0, 30, "a generation reset")
        with pytest.raises(CommitRefused, match="not a member"):
            committer.commit(tracker.ready)
        committer.abort()
        # Offsets of a committed transaction appear once its markers are written, i.e. by
        # the time the coordinator says Complete*; none may appear for this group.
        txn_id = f"{pipeline.group}-zombie"
        done = {"CompleteAbort", "CompleteCommit", "Empty"}
        state = wait_for(lambda: (s := txn_state(conn, txn_id)) in done and s, 30, "the end")
        assert state == "CompleteAbort"
        assert pipeline.committed() == {}
    finally:
        producer.close(timeout=10)
        consumer.close(autocommit=False)


def test_a_drain_timeout_leaves_no_transaction_open(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """drain() gives up on a batch the engine holds; the batch finishes while the worker
    closes its clients. Its outputs must not reach a transaction left open until its
    timeout (every read_committed reader of the output would stall behind it)."""
    settings = pipeline.settings(delivery="exactly_once", batching=_SMALL, drain_timeout_s=1.0)
    classifier, engine = classifier_with(GateEngine, settings)
    ids = pipeline.produce_requests(5)
    wt = WorkerThread(settings, classifier=classifier).start()
    worker_threads.append(wt)
    assert engine.entered.wait(60), "no batch reached the engine"
    tap = LogTap(wt.worker)
    sent = threading.Event()

    def release_and_wait_for_the_send() -> None:
        # Runs on the worker's consumer thread as it logs the timeout. Whether the late
        # batch sends shows in `answered`; it gets two seconds to.
        engine.gate.set()
        pause = threading.Event()
        for _ in range(100):
            if wt.worker.metrics.answered:
                sent.set()
                return
            pause.wait(0.02)

    tap.hooks["drain_timeout"] = release_and_wait_for_the_send
    final = wt.worker.drain()
    wt.join()
    assert "drain_timeout" in tap.events
    assert final["state"] == "stopped"
    assert txn_state(pipeline.conn, settings.transactional_id) != "Ongoing"
    # Nothing was lost: the next worker answers them, once.
    again = WorkerThread(settings).start()
    worker_threads.append(again)
    _exactly_once(pipeline.reader(read_committed=True), ids, pipeline)
    print("the late batch sent before the fix would have:", sent.is_set())
    again.worker.drain()
    again.join()


def test_a_revoke_timeout_abandons_the_open_work_instead_of_failing(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """A second member joins while the first's engine holds its batches past the revoke
    timeout: the first aborts its open work, keeps running, and reads its kept partitions
    again; every id exactly once."""
    # One batch takes every record (all are there before the worker starts, in one
    # fetch), so whichever partitions the join revokes, their records are in the engine.
    first = pipeline.settings(
        delivery="exactly_once",
        batching={"max_records": 64, "max_wait_ms": 200},
        consumer={
            "revoke_timeout_s": 1.0,
            "session_timeout_ms": 6000,
            "heartbeat_interval_ms": 1000,
        },
    )
    classifier, engine = classifier_with(GateEngine, first)
    ids = pipeline.produce_requests(60)
    a = WorkerThread(first, classifier=classifier).start()
    worker_threads.append(a)
    assert engine.entered.wait(60), "no batch reached the engine"
    tap = LogTap(a.worker)
    b = WorkerThread(first.model_copy(update={"replica": 1})).start()
    worker_threads.append(b)
    wait_for(lambda: "revoke_timeout" in tap.events, 60, "the revocation to time out")
    engine.gate.set()
    wait_for(lambda: b.worker.status()["assignment"], 60, "the second member's partitions")
    _exactly_once(pipeline.reader(read_committed=True), ids, pipeline)
    assert a.worker.status()["state"] == "running" and a.error is None
    assert a.worker.status()["transactions_aborted"] >= 1
    for w in (a, b):
        w.worker.drain()
        w.join()


def test_two_deployments_of_one_pipeline_do_not_fence_each_other(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """An upgrade runs the new deployment beside the old in the same group: replica 0 of
    each must keep running (distinct transactional ids); the group's generations fence
    between them."""
    blue, green = (
        pipeline.settings(delivery="exactly_once", deployment=d) for d in ("blue", "green")
    )
    assert blue.transactional_id != green.transactional_id
    ids = pipeline.produce_requests(400)
    a = WorkerThread(blue).start()
    worker_threads.append(a)
    reader = pipeline.reader(read_committed=True)
    reader.read_until(lambda r: len(r.records) >= 50, 60, "the first results")
    b = WorkerThread(green).start()
    worker_threads.append(b)
    wait_for(lambda: b.worker.status()["assignment"], 60, "the green replica's partitions")
    _exactly_once(reader, ids, pipeline)
    for w in (a, b):
        assert w.worker.status()["state"] == "running" and w.error is None, w.error
    for w in (a, b):
        w.worker.drain()
        w.join()


def _a_batch_held_after_the_first(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> tuple[Any, GateEngine, WorkerThread, Any, list[str]]:
    """An exactly-once worker that answered a first batch (its transactions work) and now
    holds the next at the engine: settings, engine, worker, a read_committed reader, and
    every id produced."""
    settings = pipeline.settings(delivery="exactly_once", batching=_SMALL)
    classifier, engine = classifier_with(GateEngine, settings)
    engine.gate.set()
    first = pipeline.produce_requests(8)
    wt = WorkerThread(settings, classifier=classifier).start()
    worker_threads.append(wt)
    reader = pipeline.reader(read_committed=True)
    reader.read_until(lambda r: set(r.keys()) >= set(first), 90, "the first results")
    engine.gate.clear()
    engine.entered.clear()
    ids = first + pipeline.produce_requests(8)
    assert engine.entered.wait(60), "no batch reached the engine"
    return settings, engine, wt, reader, ids


def test_a_transaction_in_an_abortable_error_state_is_aborted_and_read_again(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """Once an output of the open transaction failed (a topic deleted under its records,
    say), kafka-python puts the transaction in an abortable error state and refuses every
    later send ("Cannot perform send because at least one previous transactional ...
    request has failed"). That is not fatal: the worker aborts, reads the open work again
    and answers it once. The state is the producer's own, entered the way its sender
    enters it when a record of the transaction fails."""
    from kafka.errors import KafkaError

    _, engine, wt, reader, ids = _a_batch_held_after_the_first(pipeline, worker_threads)
    # Put the transaction in error, then let the held batch send.
    manager = wt.worker._delivery.producer._transaction_manager
    manager.transition_to_abortable_error(KafkaError("a record of the transaction failed"))
    engine.gate.set()
    _exactly_once(reader, ids, pipeline)
    assert wt.error is None, wt.error
    assert wt.worker.status()["state"] == "running"
    wt.worker.drain()
    wt.join()


def test_a_fenced_worker_stops_without_fencing_the_producer_that_fenced_it(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """Another producer initialises the worker's transactional id (a newer incarnation of
    the same replica) while a batch is at the engine. The worker's sends and its abort are
    then refused; it must stop, not set up a producer of its own again: that one would
    fence the newer incarnation and abort its transaction (the fault matrix's twin cell
    saw the two fence each other in turn)."""
    from kafka import KafkaProducer

    settings, engine, wt, _, _ = _a_batch_held_after_the_first(pipeline, worker_threads)
    newer = KafkaProducer(
        **pipeline.conn.client_kwargs(client_id="newer-incarnation"),
        transactional_id=settings.transactional_id,
    )
    try:
        newer.init_transactions()  # fences the worker's producer, aborts its transaction
        engine.gate.set()
        wait_for(lambda: wt.error is not None, 90, "the fenced worker to stop")
        assert "fenced" in str(wt.error), wt.error
        # The newer producer still owns the id: its transaction commits.
        newer.begin_transaction()
        newer.send(pipeline.output, key=b"newer", value=b"{}")
        newer.commit_transaction()
    finally:
        newer.close(timeout=10)


def test_offsets_of_a_refused_transaction_are_not_committed_by_the_next_one(
    pipeline: Pipeline,
) -> None:
    """The coordinator refuses a transaction's offsets (this member was removed from the
    group a moment before); the transaction is aborted, the member rejoins and commits
    another partition's offsets. kafka-python keeps the refused offsets as pending and sends
    them with the next transaction's: partition 0's committed offset would be set by a
    transaction that never read it (the fault matrix's broker-SIGSTOP cell saw a group's
    offset left 23 records short that way, the records answered by the member after)."""
    from kafka import TopicPartition

    from dgstream.workers.commit import ExactlyOnceCommitter, OffsetTracker
    from dgstream.workers.faults.errors import CommitRefused
    from dgstream.workers.kafka.admin import subscribe_known
    from dgstream.workers.steps.batches import Batch, Entry, Output

    conn = pipeline.conn
    # A heartbeat only every 10 s: the member learns of its removal after the commit.
    consumer, producer = _member_and_producer(pipeline, "refused", 30_000, 10_000)

    def sent(committer: ExactlyOnceCommitter, tp: TopicPartition, n: int) -> OffsetTracker:
        batch, tracker = Batch(n), OffsetTracker()
        for offset in range(n):
            batch.add(Entry(tp, offset, None, b"{}", 0))
        tracker.track(batch)
        outputs = [Output(pipeline.output, b"k", b"v", [], e, None) for e in batch.entries]
        committer.send(batch, outputs)
        return tracker

    try:
        subscribe_known(consumer, [pipeline.input])
        wait_for(lambda: consumer.poll(100) is not None and consumer.assignment(), 60, "joined")
        committer = ExactlyOnceCommitter(producer, consumer, timeout_s=30)
        committer.start()
        first = sent(committer, TopicPartition(pipeline.input, 0), 5)
        kick_member(conn, pipeline.group, consumer.group_metadata().member_id)
        with pytest.raises(CommitRefused, match="refused the commit"):
            committer.commit(first.ready)
        committer.abort()
        old = consumer.group_metadata().generation_id

        def rejoined() -> bool:
            consumer.poll(100)
            meta = consumer.group_metadata()
            return meta.generation_id > old and bool(meta.member_id and consumer.assignment())

        wait_for(rejoined, 60, "the member to rejoin")
        second = sent(committer, TopicPartition(pipeline.input, 1), 3)
        committer.commit(second.ready)
        assert pipeline.committed() == {1: 3}
    finally:
        producer.close(timeout=10)
        consumer.close(autocommit=False)

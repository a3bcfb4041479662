"""A record batch the worker cannot read, on the real broker (no Ray): one whose bytes were
damaged in the log segment (it fails its CRC), and one in a codec whose library this
process lacks. The worker stops with the cause and the place; what came before the batch
is answered and committed, the group's offset stands at the batch, nothing is
dead-lettered or skipped; `dgstream skip-batch` moves the offset past it on request, and
the next worker answers what follows.
"""

from __future__ import annotations

from typing import Any

import pytest
from support import segments

from bench.harness.pipeline import Pipeline, WorkerThread, request_bytes
from bench.harness.waiting import wait_for
from dgstream.infra.kafka.broker import BrokerInfo
from dgstream.workers.faults.poll_errors import UnreadableBatch

pytestmark = pytest.mark.broker

BEFORE, INSIDE, AFTER = 3, 4, 3  # requests before the bad batch, in it, after it


def _send(p: Pipeline, ids: list[str], *, one_batch: bool, codec: str | None = None) -> None:
    """Each request its own batch, or all of them in one (of `codec`)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(
        **p.conn.client_kwargs(),
        acks="all",
        linger_ms=1000 if one_batch else 0,
        compression_type=codec,
    )
    try:
        futures = [
            producer.send(p.input, key=rid.encode(), value=request_bytes(rid, i))
            for i, rid in enumerate(ids)
        ]
        if not one_batch:
            for f in futures:
                f.get(timeout=60)
        producer.flush(60)
        for f in futures:
            f.get(timeout=60)
    finally:
        producer.close()


def _produce_around_a_batch(p: Pipeline, codec: str | None = None) -> dict[str, list[str]]:
    ids = {
        "before": [f"b{i}" for i in range(BEFORE)],
        "inside": [f"x{i}" for i in range(INSIDE)],
        "after": [f"a{i}" for i in range(AFTER)],
    }
    _send(p, ids["before"], one_batch=False)
    _send(p, ids["inside"], one_batch=True, codec=codec)
    _send(p, ids["after"], one_batch=False)
    return ids


def _failed(p: Pipeline, threads: list[WorkerThread]) -> UnreadableBatch:
    worker = WorkerThread(p.settings()).start()
    threads.append(worker)
    wait_for(lambda: worker.error is not None, 90, "the worker to stop at the batch")
    worker.join()
    assert isinstance(worker.error, UnreadableBatch), repr(worker.error)
    assert worker.worker.status()["state"] == "failed"
    return worker.error


def _check_stopped_at_the_batch(p: Pipeline, ids: dict[str, list[str]], err: Any) -> None:
    assert (err.topic, err.partition, err.offset) == (p.input, 0, BEFORE), err.as_dict()
    # What came before is answered and committed; the offset stands at the batch.
    out = p.reader()
    out.read_to_end()
    assert sorted(out.keys()) == sorted(ids["before"])
    assert p.committed() == {0: BEFORE}
    dead = p.reader(p.dead)
    dead.read_to_end()
    assert dead.records == []


def _cli(*args: str) -> tuple[int, str, str]:
    """`dgstream ARGS` in this process (no Ray involved): (status, stdout, stderr). Plain
    buffers, not pytest's capture: a logger set up meanwhile keeps its stream, and pytest
    closes its own after the test."""
    import contextlib
    import io

    from dgstream.topology.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(list(args))
    return rc, out.getvalue(), err.getvalue()


def _skip_and_resume(
    p: Pipeline,
    ids: dict[str, list[str]],
    threads: list[WorkerThread],
    bootstrap: str,
) -> None:
    base = ("skip-batch", p.group, p.input, "0")
    # The offset named must be where the group stands.
    rc, _, err = _cli(*base, str(BEFORE + 1), "--bootstrap", bootstrap)
    assert rc == 2 and f"at {BEFORE}, not {BEFORE + 1}" in err, err
    rc, out, err = _cli(*base, str(BEFORE), "--bootstrap", bootstrap, "--dry-run")
    assert rc == 0, err
    assert f"offsets {BEFORE}..{BEFORE + INSIDE - 1} ({INSIDE} record(s)" in out
    assert p.committed() == {0: BEFORE}
    # The group must be empty: with a member in it (here one reading another topic),
    # nothing moves.
    from kafka import KafkaConsumer

    from dgstream.workers.kafka.admin import subscribe_known

    member = KafkaConsumer(group_id=p.group, **p.conn.client_kwargs())
    subscribe_known(member, [p.output])
    try:
        wait_for(lambda: member.poll(timeout_ms=200) is not None and p.members() == 1, 60, "")
        rc, _, err = _cli(*base, str(BEFORE), "--bootstrap", bootstrap)
    finally:
        member.close(autocommit=False)
    assert rc == 2 and "member" in err, err
    assert p.committed() == {0: BEFORE}
    rc, out, err = _cli(*base, str(BEFORE), "--bootstrap", bootstrap)
    assert rc == 0 and f"{INSIDE} record(s) skipped" in out, err
    assert p.committed() == {0: BEFORE + INSIDE}
    # The next worker answers what follows; the skipped records never are.
    worker = WorkerThread(p.settings()).start()
    threads.append(worker)
    out = p.reader()
    out.read_until(lambda r: set(ids["after"]) <= set(r.keys()), 90, "the records after")
    worker.worker.drain(30)
    out.read_to_end()
    assert not set(out.keys()) & set(ids["inside"])
    assert p.committed() == {0: BEFORE + INSIDE + AFTER}


def test_a_corrupt_batch_stops_the_worker_and_is_skipped_only_on_request(
    one_partition: Pipeline,
    worker_threads: list[WorkerThread],
    kafka_broker: BrokerInfo,
) -> None:
    p = one_partition
    ids = _produce_around_a_batch(p)
    data = kafka_broker.nodes[0].data_dir
    (bad,) = [b for b in segments.batches(data, p.input, 0) if b.base_offset == BEFORE]
    assert bad.last_offset == BEFORE + INSIDE - 1  # the premise: one batch of INSIDE records
    segments.corrupt(bad)
    err = _failed(p, worker_threads)
    assert err.cause == "CORRUPT_BATCH", err.as_dict()
    assert "crc" in err.detail.lower()
    _check_stopped_at_the_batch(p, ids, err)
    _skip_and_resume(p, ids, worker_threads, kafka_broker.bootstrap)


def test_a_codec_this_process_lacks_is_named(
    one_partition: Pipeline,
    worker_threads: list[WorkerThread],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import kafka.codec

    p = one_partition
    ids = _produce_around_a_batch(p, codec="snappy")
    # As kafka-python sees a process without python-snappy (its has_snappy() test).
    monkeypatch.setattr(kafka.codec, "snappy", None)
    err = _failed(p, worker_threads)
    assert err.cause == "UNSUPPORTED_CODEC", err.as_dict()
    assert "snappy" in err.detail
    _check_stopped_at_the_batch(p, ids, err)
    # With the library back, the same batch is read: nothing was skipped.
    monkeypatch.undo()
    worker = WorkerThread(p.settings()).start()
    worker_threads.append(worker)
    out = p.reader()
    want = {k for v in ids.values() for k in v}
    out.read_until(lambda r: want <= set(r.keys()), 90, "every request answered")


def _undecodable(batch: segments.Batch) -> None:
    """Spoil the batch's zstd frame (its magic number, the first bytes after the batch's
    61-byte header) and write the CRC that covers the new bytes: the batch passes its CRC
    check and the codec refuses it."""
    from kafka.record.util import calc_crc32c

    header, crc_at, attrs_at = 61, 17, 21
    with open(batch.file, "r+b") as f:
        f.seek(batch.position)
        data = bytearray(f.read(batch.size))
        data[header : header + 4] = b"\xff\xff\xff\xff"
        data[crc_at : crc_at + 4] = calc_crc32c(bytes(data[attrs_at:])).to_bytes(4, "big")
        f.seek(batch.position)
        f.write(data)


def test_a_batch_its_codec_refuses_stops_the_worker_as_undecodable(
    one_partition: Pipeline,
    worker_threads: list[WorkerThread],
    kafka_broker: BrokerInfo,
) -> None:
    """The worker's consumer decompresses within its memory bound (`workers.kafka.decompress`):
    what the codec library refuses there is still UNDECODABLE_BATCH, not a worker error
    and not a bomb to dead-letter."""
    p = one_partition
    ids = _produce_around_a_batch(p, codec="zstd")
    data = kafka_broker.nodes[0].data_dir
    (bad,) = [b for b in segments.batches(data, p.input, 0) if b.base_offset == BEFORE]
    assert bad.codec == "zstd" and bad.last_offset == BEFORE + INSIDE - 1
    _undecodable(bad)
    err = _failed(p, worker_threads)
    assert err.cause == "UNDECODABLE_BATCH", err.as_dict()
    assert "zstd" in err.detail.lower()
    _check_stopped_at_the_batch(p, ids, err)
    _skip_and_resume(p, ids, worker_threads, kafka_broker.bootstrap)


@pytest.mark.timeout(120)  # without the workaround, poll() never returns
def test_an_unreadable_batch_still_raises_after_its_partition_was_paused(
    one_partition: Pipeline, kafka_broker: BrokerInfo
) -> None:
    """kafka-python hands out the records before the bad batch and keeps its error for the
    next poll, which drops it when the partition is paused by then (the worker's
    backpressure pauses every partition while its slots are full). The error must come
    once the partition is resumed; kafka-python alone loses it, and its next poll never
    returns (it loops on the used-up records: `keep_unread_errors`)."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import CorruptRecordError

    p = one_partition
    _send(p, [f"b{i}" for i in range(BEFORE)], one_batch=False)
    _send(p, [f"x{i}" for i in range(INSIDE)], one_batch=True)
    (bad,) = [
        b
        for b in segments.batches(kafka_broker.nodes[0].data_dir, p.input, 0)
        if b.base_offset == BEFORE
    ]
    segments.corrupt(bad)
    tp = TopicPartition(p.input, 0)
    consumer = KafkaConsumer(
        **p.conn.client_kwargs(client_id="paused-reader"),
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    try:
        consumer.assign([tp])
        got: list[Any] = []
        wait_for(
            lambda: got.extend(consumer.poll(timeout_ms=200).get(tp, [])) or len(got) >= BEFORE,
            60,
            "the records before the batch",
        )
        assert [r.offset for r in got] == list(range(BEFORE))
        consumer.pause(tp)
        assert consumer.poll(timeout_ms=0) == {}
        consumer.resume(tp)

        def raises() -> bool:
            try:
                assert consumer.poll(timeout_ms=100) == {}
            except CorruptRecordError:
                return True
            return False

        wait_for(raises, 30, "the batch's error once the partition is resumed")
        assert consumer.position(tp) == BEFORE
    finally:
        consumer.close(autocommit=False)

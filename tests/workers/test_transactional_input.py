"""Input from a transactional producer (Kafka Streams, Flink, any exactly-once upstream):
every transaction leaves a marker in each partition it wrote, and an aborted one leaves
records no read_committed consumer returns. A partition whose last offsets are such is
still drained: the group's lag reaches 0, so backlog-driven scaling and `dgstream status`
see no work that is not there. Both delivery modes, a real broker."""

from __future__ import annotations

import pytest

from bench.harness.pipeline import Pipeline, WorkerThread, request_bytes
from bench.harness.waiting import wait_for

pytestmark = pytest.mark.broker


def _upstream(p: Pipeline) -> tuple[set[str], set[str]]:
    """Partition 0 ends in a committed transaction's marker; partition 1 in an aborted
    transaction (its records, then its marker). Returns (committed ids, aborted ids)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(
        **p.conn.client_kwargs(client_id="dgstream-tests-upstream"),
        transactional_id=f"upstream-{p.input}",
        enable_idempotence=True,
        acks="all",
    )
    kept = {0: ["t0-0", "t0-1", "t0-2"], 1: ["t1-0", "t1-1"]}
    dropped = ["t1-100", "t1-101"]

    def send(part: int, rid: str, i: int) -> None:
        producer.send(p.input, value=request_bytes(rid, i), key=rid.encode(), partition=part)

    try:
        producer.init_transactions()
        producer.begin_transaction()
        for part, ids in kept.items():
            for i, rid in enumerate(ids):
                send(part, rid, i)
        producer.commit_transaction()
        producer.begin_transaction()
        for i, rid in enumerate(dropped):
            send(1, rid, 100 + i)
        producer.flush()
        producer.abort_transaction()
    finally:
        producer.close(timeout=10)
    return {rid for ids in kept.values() for rid in ids}, set(dropped)


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_a_partition_ending_in_markers_or_aborted_records_drains_to_lag_0(
    pipeline: Pipeline, worker_threads: list[WorkerThread], delivery: str
) -> None:
    p = pipeline
    want, aborted = _upstream(p)
    worker = WorkerThread(p.settings(delivery=delivery)).start()
    worker_threads.append(worker)
    out = p.reader(read_committed=True)
    out.read_until(lambda r: worker.error is not None or want <= set(r.keys()), 60, "every result")
    assert worker.error is None, worker.error
    # Partition 0: three records and the commit marker (offsets 0-3); partition 1: two
    # records, the commit marker, two aborted records and the abort marker (0-5). The
    # other partitions are empty (nothing to commit, no lag).
    wait_for(lambda: p.lag() == 0, 30, "the group's lag to reach 0")
    assert p.committed() == {0: 4, 1: 6}
    out.read_to_end()
    assert sorted(out.keys()) == sorted(want) and not aborted & set(out.keys())
    assert worker.error is None, worker.error

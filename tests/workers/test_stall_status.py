"""A worker says it is STALLED when it holds records whose committed offsets do not move for
`stall_after_s`, and only then.

On a fake clock: the progress clock's rules (when a partition counts from, what resets it,
what excuses it, the consumer that stops polling). On a real broker: an engine that blocks
(bench/harness/faults.py GateEngine) stalls the worker within the window and it recovers when the
gate opens; an outage's backoff, transaction markers and a transaction still open upstream
(backlog the consumer is never given) never read as a stall.
"""

from __future__ import annotations

from typing import Any

import pytest

from bench.harness.faults import DownEngine, GateEngine, LogTap, classifier_with
from bench.harness.pipeline import Pipeline, WorkerThread, request_bytes
from bench.harness.waiting import wait_for
from dgstream.workers.hosting.metrics import WORKER_STATES, WorkerMetrics
from dgstream.workers.hosting.status import ProgressClock, ReplicaReport, Stall

# ------------------------------------------------------------------ the clock (unit)


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _clock(stall_after_s: float = 10.0) -> tuple[ProgressClock, FakeClock]:
    fake = FakeClock()
    return ProgressClock(stall_after_s, clock=fake), fake


@pytest.mark.unit
def test_a_held_partition_stalls_counted_from_its_oldest_batch() -> None:
    clock, t = _clock(10)
    # The first read already knows the work started 8 s ago (the batch's start time).
    waited, stall = clock.read({"in-0": t.now - 8}, {"in-0": 5}, lag={"in-0": 3})
    assert waited == {"in-0": 8.0} and stall is None
    t.now += 2
    waited, stall = clock.read({"in-0": t.now - 10}, {"in-0": 5}, lag={"in-0": 3})
    assert stall is not None and stall.partitions == {"in-0": 10.0}
    assert stall.describe() == "no progress for 10 s on in-0 (lag 3)"
    assert stall.for_s == 10.0


@pytest.mark.unit
@pytest.mark.parametrize(
    ("change", "expect_stall"),
    [
        ({"committed": 6}, False),  # a commit moved it: progress
        ({"committed": 4}, False),  # moved back (sought to a new owner's commit): a new start
        ({"excused": True}, False),  # an outage: its backoff is no stall
        ({}, True),  # nothing moved
    ],
    ids=["commit-forward", "commit-back", "outage", "nothing"],
)
def test_what_counts_as_progress(change: dict[str, Any], expect_stall: bool) -> None:
    clock, t = _clock(10)
    started = t.now
    clock.read({"in-0": started}, {"in-0": 5})
    t.now += 6
    clock.read(
        {"in-0": started},
        {"in-0": change.get("committed", 5)},
        excused=change.get("excused", False),
    )
    t.now += 6  # 12 s since the batch started, 6 s since the change
    _, stall = clock.read({"in-0": started}, {"in-0": change.get("committed", 5)})
    assert (stall is not None) is expect_stall, stall


@pytest.mark.unit
def test_an_outage_excuses_every_partition_while_it_lasts() -> None:
    clock, t = _clock(10)
    started = t.now
    for _ in range(5):
        t.now += 30
        waited, stall = clock.read({"in-0": started, "in-1": started}, {}, excused=True)
        assert stall is None and waited == {"in-0": 0.0, "in-1": 0.0}
    t.now += 9
    assert clock.read({"in-0": started}, {})[1] is None  # 9 s since the outage ended
    t.now += 1
    assert clock.read({"in-0": started}, {})[1] is not None


@pytest.mark.unit
def test_a_partition_no_longer_held_starts_over_with_its_next_batch() -> None:
    clock, t = _clock(10)
    clock.read({"in-0": t.now}, {"in-0": 5})
    t.now += 9
    clock.read({}, {"in-0": 9})  # committed, nothing held
    t.now += 20
    # New work on it, started 1 s ago: 1 s without progress, not 29.
    waited, stall = clock.read({"in-0": t.now - 1}, {"in-0": 9})
    assert waited == {"in-0": 1.0} and stall is None


@pytest.mark.unit
def test_the_worst_partitions_are_named_first() -> None:
    clock, t = _clock(10)
    held = {f"in-{i}": t.now - 10 - i for i in range(6)}
    _, stall = clock.read(held, {}, lag={"in-5": 7})
    assert stall is not None
    assert stall.describe() == ("no progress for 15 s on in-5 (lag 7), in-4, in-3, in-2 and 2 more")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("held", "lag", "quiet_s", "stalled"),
    [
        ({}, {"in-0": 4}, 12, True),  # owns lag, the consumer thread stopped polling
        ({}, {"in-0": 4}, 3, False),  # polling: lag it is not given (markers, an open txn)
        ({}, {"in-0": 0}, 60, False),  # nothing to do at all
        ({}, {}, 60, False),
    ],
    ids=["stuck-with-lag", "polling-with-lag", "stuck-no-lag", "no-partitions"],
)
def test_a_consumer_that_stops_polling_while_it_owns_lag(
    held: dict[str, float], lag: dict[str, int], quiet_s: float, stalled: bool
) -> None:
    clock, t = _clock(10)
    _, stall = clock.read(held, {}, last_poll=t.now - quiet_s, lag=lag)
    assert (stall is not None) is stalled, stall
    if stall is not None:
        assert stall.describe() == "the consumer has not polled for 12 s (lag 4)"


@pytest.mark.unit
def test_a_stalled_replica_is_not_ready_and_says_why() -> None:
    stalled = ReplicaReport("running", "a", 3, 0, 1.0, stall="no progress for 9 s on in-0")
    assert not stalled.ready
    assert stalled.shown_state == "stalled: no progress for 9 s on in-0"
    assert ReplicaReport("running", "a", 3, 0, 1.0).ready
    # A stall only means something while running; an error wins over it.
    draining = ReplicaReport("draining", "a", 3, 0, 1.0, stall="x")
    assert draining.shown_state == "draining"
    failed = ReplicaReport("running", "a", 3, 0, 1.0, error="kafka: refused", stall="x")
    assert failed.shown_state == "running: kafka: refused"


@pytest.mark.unit
def test_the_state_metric_keeps_one_state_at_a_time() -> None:
    m = WorkerMetrics("p", "w", use_ray=False)
    for state in ("starting", "running", "stalled", "running", "running"):
        m.set_state(state)
        assert m.state == state
    assert set(WORKER_STATES) >= {"running", "stalled", "failed", "draining"}


@pytest.mark.unit
def test_a_stall_with_both_reasons_names_both() -> None:
    s = Stall({"in-1": 30.0}, 45.0, {"in-1": 2, "in-2": 3})
    assert s.for_s == 45.0
    assert s.describe() == (
        "no progress for 30 s on in-1 (lag 2); the consumer has not polled for 45 s (lag 5)"
    )


# ------------------------------------------------------------------ a real broker

STALL_AFTER_S = 1.5
_SMALL = {"max_records": 4, "max_wait_ms": 20}


def _stall(worker: Any) -> dict[str, Any] | None:
    status: dict[str, Any] = worker.status()
    stall: dict[str, Any] | None = status["stall"]
    return stall


def _never_stalled_while(worker: Any, holds: Any, span_s: float, what: str) -> None:
    """Poll the worker's status until `holds(status)` has been true for `span_s` of the
    worker's own uptime (several stall windows), failing at any poll that shows a stall."""
    since: list[float] = []

    def watched() -> bool:
        status = worker.status()
        assert status["stall"] is None, status["stall"]
        if not holds(status):
            since.clear()
            return False
        since[:1] = since[:1] or [status["uptime_s"]]
        return bool(status["uptime_s"] - since[0] >= span_s)

    wait_for(watched, 120, what, every_s=0.1)


@pytest.mark.broker
def test_an_engine_that_blocks_stalls_the_worker_until_the_gate_opens(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    settings = pipeline.settings(batching=_SMALL, stall_after_s=STALL_AFTER_S)
    classifier, engine = classifier_with(GateEngine, settings)
    ids = pipeline.produce_requests(12)
    wt = WorkerThread(settings, classifier=classifier).start()
    worker_threads.append(wt)
    tap = LogTap(wt.worker)
    assert engine.entered.wait(60), "no batch reached the engine"
    stall = wait_for(lambda: _stall(wt.worker), 60, "the worker to say it is stalled")
    status = wt.worker.status()
    assert status["state"] == "running"
    assert stall["partitions"] and set(stall["partitions"]) <= set(status["assignment"])
    assert min(stall["partitions"].values()) >= STALL_AFTER_S
    assert stall["reason"].startswith("no progress for "), stall
    assert wt.worker.stall() is not None
    # The gate opens: everything is answered, committed, and the stall is over.
    engine.gate.set()
    out = pipeline.reader()
    out.read_until(lambda r: set(r.keys()) >= set(ids), 60, "every result")
    wait_for(lambda: pipeline.lag() == 0, 60, "the group's lag to reach 0")
    wait_for(lambda: _stall(wt.worker) is None, 30, "the stall to end")
    assert wt.worker.stall() is None and wt.error is None
    assert tap.events.count("worker_stalled") == 1, tap.events
    assert "worker_progressing" in tap.events
    wt.worker.drain()
    wt.join()


@pytest.mark.broker
def test_an_outage_is_not_a_stall(pipeline: Pipeline, worker_threads: list[WorkerThread]) -> None:
    settings = pipeline.settings(batching=_SMALL, stall_after_s=STALL_AFTER_S)
    classifier, engine = classifier_with(DownEngine, settings)
    ids = pipeline.produce_requests(6)
    wt = WorkerThread(settings, classifier=classifier).start()
    worker_threads.append(wt)
    # The engine is out of reach for three stall windows and more: the outage shows,
    # its held-back work never reads as a stall.
    _never_stalled_while(
        wt.worker,
        lambda st: st["outage"] is not None,
        3 * STALL_AFTER_S,
        "an outage of three stall windows",
    )
    engine.down.clear()
    out = pipeline.reader()
    out.read_until(lambda r: set(r.keys()) >= set(ids), 90, "every result")
    wait_for(lambda: wt.worker.status()["outage"] is None, 30, "the outage to end")
    assert _stall(wt.worker) is None and wt.error is None
    wt.worker.drain()
    wt.join()


@pytest.mark.broker
def test_markers_and_a_transaction_open_upstream_are_not_a_stall(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    """The worker's lag counts the high watermark: records of a transaction still open
    upstream, and each transaction's marker. Neither is work the consumer is given
    (read_committed), so neither is a stall, however long it lasts."""
    from kafka import KafkaProducer

    p = pipeline
    wt = WorkerThread(p.settings(batching=_SMALL, stall_after_s=STALL_AFTER_S)).start()
    worker_threads.append(wt)
    wait_for(lambda: wt.worker.status()["assignment"], 60, "the worker to own partitions")
    producer = KafkaProducer(
        **p.conn.client_kwargs(client_id="dgstream-tests-upstream"),
        transactional_id=f"upstream-{p.input}",
        enable_idempotence=True,
        acks="all",
    )
    out = p.reader(read_committed=True)
    try:
        producer.init_transactions()
        producer.begin_transaction()
        for i in range(4):
            rid = f"c{i}"
            producer.send(p.input, value=request_bytes(rid, i), key=rid.encode(), partition=i % 2)
        producer.commit_transaction()
        want = {f"c{i}" for i in range(4)}
        out.read_until(lambda r: want <= set(r.keys()), 60, "the committed four")
        # Partitions 0 and 1 end in the transaction's marker: committed past it (lag 0),
        # and no stall meanwhile.
        wait_for(lambda: p.lag() == 0, 60, "the group's lag to reach 0 past the markers")
        _never_stalled_while(
            wt.worker, lambda st: True, 2 * STALL_AFTER_S, "two stall windows after the markers"
        )
        # Now a transaction left open: partition 1's high watermark moves, its last stable
        # offset does not.
        producer.begin_transaction()
        for i in range(3):
            producer.send(p.input, value=request_bytes(f"o{i}", i), key=b"o%d" % i, partition=1)
        producer.flush()
        lagging = next(t for t in wt.worker.status()["assignment"] if t.endswith("-1"))
        _never_stalled_while(
            wt.worker,
            lambda st: st["lag"].get(lagging, 0) > 0,
            3 * STALL_AFTER_S,
            "the open transaction's lag for three stall windows",
        )
        producer.commit_transaction()
    finally:
        producer.close(timeout=10)
    out.read_until(lambda r: {"o0", "o1", "o2"} <= set(r.keys()), 60, "the open three, committed")
    wait_for(lambda: p.lag() == 0, 60, "the group's lag to reach 0")
    assert _stall(wt.worker) is None and wt.error is None
    wt.worker.drain()
    wt.join()

"""The real broker: produce, consume, commit, and the exact lag `compute_lag` reports."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from kafka import KafkaConsumer, KafkaProducer, OffsetAndMetadata, OffsetSpec, TopicPartition

from bench.harness.waiting import wait_for
from dgstream.infra.kafka import broker
from dgstream.infra.kafka.broker import BrokerInfo
from dgstream.workers.kafka.admin import compute_lag, ensure_topics, subscribe_known, total_lag

pytestmark = pytest.mark.broker

REPO = Path(__file__).resolve().parents[3]
N_MESSAGES = 100
N_PARTITIONS = 3


def _produce(bootstrap: list[str], topic: str) -> Counter[int]:
    """N messages, message i to partition i % P; returns the count per partition."""
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=True,
        client_id="dgstream-test-producer",
    )
    try:
        futures = [
            producer.send(
                topic, key=f"k{i}".encode(), value=f"m{i}".encode(), partition=i % N_PARTITIONS
            )
            for i in range(N_MESSAGES)
        ]
        producer.flush(timeout=30)
        metas = [f.get(timeout=30) for f in futures]
    finally:
        producer.close(timeout=10)
    per_partition = Counter(m.partition for m in metas)
    for p, count in per_partition.items():  # acknowledged, in order, no gaps, no duplicates
        assert sorted(m.offset for m in metas if m.partition == p) == list(range(count))
    return per_partition


def _earliest(admin: Any, tp: TopicPartition) -> int:
    return int(admin.list_partition_offsets({tp: OffsetSpec.EARLIEST})[tp].offset)


def test_lag_is_exact(kafka_broker: BrokerInfo, kafka_admin: Any, topic: str, group: str) -> None:
    assert ensure_topics(kafka_admin, {topic: N_PARTITIONS}) == {topic: N_PARTITIONS}
    per_partition = _produce(kafka_broker.bootstrap_servers, topic)
    assert per_partition == {0: 34, 1: 33, 2: 33}
    tp0, tp1, tp2 = (TopicPartition(topic, p) for p in range(N_PARTITIONS))

    # The group has committed nothing yet: everything is backlog (from the beginning).
    assert compute_lag(kafka_broker.bootstrap, group, [topic]) == {tp0: 34, tp1: 33, tp2: 33}

    consumer = KafkaConsumer(
        bootstrap_servers=kafka_broker.bootstrap_servers,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        client_id="dgstream-test-consumer",
    )
    # Not KafkaConsumer(topic, ...): its first join can race its first metadata response
    # and leave the group assigned nothing for 5 minutes (CI hit it on 2026-12-01).
    subscribe_known(consumer, [topic])
    try:
        seen: list[bytes] = []

        def consumed_all() -> bool:
            for records in consumer.poll(timeout_ms=200).values():
                seen.extend(r.value for r in records)
            return len(seen) >= N_MESSAGES

        wait_for(consumed_all, 60, "the consumer to read every message")
        assert sorted(seen) == sorted(f"m{i}".encode() for i in range(N_MESSAGES))
        # Commit a known position on two partitions; none on the third.
        consumer.commit({tp0: OffsetAndMetadata(10, "", -1), tp1: OffsetAndMetadata(20, "", -1)})
    finally:
        consumer.close()

    lag = compute_lag(kafka_admin, group, [topic])
    assert lag == {tp0: 34 - 10, tp1: 33 - 20, tp2: 33}
    assert total_lag(lag) == N_MESSAGES - 10 - 20

    # No commit on p2: lag counts from its beginning offset, which deleting records moves.
    kafka_admin.delete_records({tp2: 5})
    wait_for(lambda: _earliest(kafka_admin, tp2) == 5, 10, "p2's beginning offset to be 5")
    assert compute_lag(kafka_admin, group, [topic])[tp2] == 33 - 5

    # A commit below the beginning (records removed by retention) also counts from it.
    kafka_admin.delete_records({tp0: 15})
    wait_for(lambda: _earliest(kafka_admin, tp0) == 15, 10, "p0's beginning offset to be 15")
    assert compute_lag(kafka_admin, group, [topic]) == {tp0: 34 - 15, tp1: 13, tp2: 28}


def test_ensure_topics_is_idempotent_and_grows(kafka_admin: Any, unique_name: Any) -> None:
    a, b = unique_name("a"), unique_name("b")
    assert ensure_topics(kafka_admin, [a, b], partitions=2) == {a: 2, b: 2}
    assert ensure_topics(kafka_admin, {a: 2, b: 4}) == {a: 2, b: 2}  # existing: kept
    assert ensure_topics(kafka_admin, {b: 4}, grow_partitions=True) == {b: 4}


def test_compute_lag_unknown_topic_raises(kafka_broker: BrokerInfo, unique_name: Any) -> None:
    from kafka.errors import UnknownTopicOrPartitionError

    with pytest.raises(UnknownTopicOrPartitionError):
        compute_lag(kafka_broker.bootstrap, unique_name("g"), [unique_name("missing")])


@pytest.mark.parametrize("listener", [False, True])
def test_subscribe_known_knows_the_partitions_before_the_first_join(
    kafka_broker: BrokerInfo, kafka_admin: Any, unique_name: Any, listener: bool
) -> None:
    """After `subscribe_known` and before any poll, the consumer's own metadata (what its
    first JoinGroup's assignment reads) holds every partition of the topic; the lone member
    then gets them all. A plain `subscribe` leaves that metadata empty (the CI stalls)."""
    from kafka import ConsumerRebalanceListener
    from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor

    topic = unique_name("sub")
    ensure_topics(kafka_admin, {topic: N_PARTITIONS})
    consumer = KafkaConsumer(
        bootstrap_servers=kafka_broker.bootstrap,
        group_id=unique_name("g"),
        enable_auto_commit=False,
        partition_assignment_strategy=[CooperativeStickyAssignor],
    )
    assigned: list[set[TopicPartition]] = []

    class Seen(ConsumerRebalanceListener):  # type: ignore[misc]
        def on_partitions_revoked(self, revoked: Any) -> None:
            pass

        def on_partitions_assigned(self, got: Any) -> None:
            assigned.append(set(got))

    try:
        subscribe_known(consumer, [topic], listener=Seen() if listener else None)
        known = consumer._cluster.partitions_for_topic(topic)  # no public view of it
        assert known == set(range(N_PARTITIONS))
        want = {TopicPartition(topic, p) for p in range(N_PARTITIONS)}

        def all_assigned() -> bool:
            consumer.poll(timeout_ms=100)
            return consumer.assignment() == want

        wait_for(all_assigned, 60, "every partition assigned to the lone member")
        assert assigned == ([want] if listener else [])
    finally:
        consumer.close()


# --------------------------------------------------------------------------- lifecycle


@pytest.fixture
def no_maven(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """An environment in which running Maven fails loudly (and could not reach a repo)."""
    broker.fetch()  # the cache must be there first (this may use the network once)
    fake_bin = tmp_path / "fake-bin"
    fake_bin.mkdir()
    mvn = fake_bin / "mvn"
    mvn.write_text("#!/bin/sh\necho 'fake mvn: Maven must not run here' >&2\nexit 97\n")
    mvn.chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("MAVEN_OPTS", "-Dmaven.repo.local=/nonexistent -o")
    return dict(os.environ)


def test_fetch_reuses_cache_without_maven(no_maven: dict[str, str], tmp_path: Path) -> None:
    r = broker.fetch()
    assert not r.fetched
    assert r.jars > 10
    assert broker.marker_path().is_file()

    out = subprocess.run(
        [sys.executable, "-m", "dgstream.infra.kafka.broker", "fetch", "--json"],
        cwd=REPO,
        env=no_maven,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["fetched"] is False

    # A marker for another pom means a download (of the lock's jars, never by Maven);
    # a lock made for another pom is refused, naming the fix.
    stale = tmp_path / "stale-lib"
    stale.mkdir()
    (stale / "kafka_2.13-0.0.0.jar").write_bytes(b"")
    (stale / broker.MARKER_NAME).write_text(
        json.dumps({"pom_sha256": "0" * 64, "jars": ["kafka_2.13-0.0.0.jar"]})
    )
    other = tmp_path / "other.lock.json"
    other.write_text(json.dumps({**broker.jars.read_lock(), "pom_sha256": "1" * 64}))
    with pytest.raises(broker.BrokerError, match=r"infra\.kafka\.broker lock"):
        broker.fetch(stale, lock_file=other)


def _send(bootstrap: str, topic: str, value: bytes) -> None:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    try:
        producer.send(topic, value=value).get(timeout=60)
    finally:
        producer.close(timeout=10)


def _values(bootstrap: str, topic: str) -> list[bytes]:
    """Every value of partition 0 of `topic`, from its beginning to its end."""
    c = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    try:
        tp = TopicPartition(topic, 0)
        c.assign([tp])
        c.seek_to_beginning(tp)
        end = c.end_offsets([tp])[tp]
        out: list[bytes] = []
        while c.position(tp) < end:
            out += [r.value for recs in c.poll(timeout_ms=500).values() for r in recs]
        return out
    finally:
        c.close()


@pytest.mark.slow
def test_start_status_stop_round_trip(no_maven: dict[str, str], tmp_path: Path) -> None:
    """Runs with a Maven that cannot work: starting reuses the cached jars. A stop keeps
    the data, and the next start resumes it (same cluster, port, records); a stop with
    delete_data removes it, and the next start is a new cluster."""
    home = tmp_path / "home"
    assert broker.status(home)["running"] is False
    info = broker.start(home, port=0)
    try:
        assert not info.reused and not info.resumed
        assert info.start_seconds > 0
        st = broker.status(home)
        assert st["running"] and st["answers_metadata"] and not st["data_kept"]
        assert st["bootstrap"] == info.bootstrap
        assert st["pid"] == info.pid
        assert json.loads((home / "state.json").read_text())["nodes"][0]["pid"] == info.pid

        again = broker.start(home, port=0)  # idempotent
        assert again.reused and again.pid == info.pid and again.bootstrap == info.bootstrap
        ensure_topics(info.bootstrap, {"kept": 1})
        _send(info.bootstrap, "kept", b"before the stop")
    finally:
        assert broker.stop(home) is True
    st = broker.status(home)
    assert not st["running"] and st["data_kept"], st
    with pytest.raises(ProcessLookupError):
        os.kill(info.pid, 0)
    assert broker.stop(home) is False  # nothing running

    resumed = broker.start(home, port=0)  # the kept data: same cluster, port and records
    try:
        assert resumed.resumed and not resumed.reused
        assert resumed.cluster_id == info.cluster_id and resumed.bootstrap == info.bootstrap
        assert resumed.pid != info.pid
        _send(resumed.bootstrap, "kept", b"after the restart")
        assert _values(resumed.bootstrap, "kept") == [b"before the stop", b"after the restart"]
    finally:
        assert broker.stop(home) is True
    with pytest.raises(broker.BrokerError, match="--delete-data"):
        broker.start_cluster(3, home)  # another shape than the kept data's
    with pytest.raises(broker.BrokerError, match="not 1"):
        broker.start(home, port=1)  # another port than the kept data's
    assert broker.stop(home, delete_data=True) is True  # nothing ran; the data goes
    st = broker.status(home)
    assert st == {"running": False, "answers_metadata": False, "home": str(home)}
    assert broker.stop(home, delete_data=True) is False

    fresh = broker.start(home, port=0)  # after delete_data: a new cluster
    try:
        assert not fresh.reused and not fresh.resumed and fresh.cluster_id != info.cluster_id
        assert broker.status(home)["answers_metadata"]
    finally:
        broker.stop(home, delete_data=True)


@pytest.mark.slow
def test_three_node_cluster_survives_one_node(tmp_path: Path, unique_name: Any) -> None:
    home = tmp_path / "cluster"
    info = broker.start_cluster(3, home)
    try:
        assert len(info.bootstrap_servers) == 3
        t = unique_name("rf3")
        ensure_topics(info.bootstrap, {t: 3}, replication_factor=3)
        broker.kill_node(2, home)
        st = broker.status(home)
        assert st["nodes_alive"] == {"1": True, "2": False, "3": True}
        assert st["answers_metadata"]
        # acks=all with min.insync.replicas=2 still succeeds with one of three nodes down.
        producer = KafkaProducer(
            bootstrap_servers=[info.node(1).bootstrap, info.node(3).bootstrap],
            acks="all",
            enable_idempotence=True,
        )
        try:
            for i in range(10):
                producer.send(t, value=f"x{i}".encode(), partition=i % 3).get(timeout=60)
        finally:
            producer.close(timeout=10)
        broker.restart_node(2, home)
        assert broker.status(home)["all_nodes_running"]
        assert compute_lag(info.bootstrap, unique_name("g"), [t]) == {
            TopicPartition(t, p): n for p, n in {0: 4, 1: 3, 2: 3}.items()
        }
    finally:
        broker.stop(home, delete_data=True)

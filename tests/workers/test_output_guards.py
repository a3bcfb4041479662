"""Where outputs may go and the poison guard's protocol, without a broker: the reply-topic
allow-list, the cluster's answers (a fake `describe`), the limits records must fit, and the
attempt counts kept in committed offsets' metadata."""

from __future__ import annotations

from typing import Any

import pytest
from kafka import TopicPartition

from dgstream.schemas import ErrorCode
from dgstream.workers.faults.poison import PROGRESS, Attempts, PoisonGuard, parse_attempts
from dgstream.workers.hosting.settings import PoisonTuning, WorkerSettings
from dgstream.workers.kafka.settings import KafkaConnection
from dgstream.workers.steps.topics import BAD_TTL_S, Limit, TopicGuard, batch_size, record_size

pytestmark = pytest.mark.unit

TP = TopicPartition("requests", 0)
T_OTHER = TopicPartition("requests", 1)


def _settings(**kw: Any) -> WorkerSettings:
    return WorkerSettings(
        pipeline="p",
        input_topics=["requests"],
        output_topic="results",
        dead_letter_topic="dead",
        group_id="g",
        kafka=KafkaConnection(bootstrap_servers="127.0.0.1:9092"),
        **kw,
    )


class Cluster:
    """Answers `describe(topic)` like a cluster would; counts the questions."""

    def __init__(self) -> None:
        self.topics: dict[str, dict[str, Any]] = {}
        self.asked: list[str] = []

    def add(
        self,
        name: str,
        max_bytes: int = 1_048_588,
        ops: list[str] | None = None,
        codec: str = "producer",
    ) -> None:
        ops = ops if ops is not None else ["READ", "WRITE", "DESCRIBE"]
        self.topics[name] = {"error_code": 0, "is_internal": False, "authorized_operations": ops}
        self.topics[name]["max"] = max_bytes
        self.topics[name]["codec"] = codec

    def describe(self, topic: str) -> tuple[dict[str, Any], int | None, str | None]:
        self.asked.append(topic)
        meta = self.topics.get(topic, {"error_code": 3, "is_internal": topic.startswith("__")})
        return meta, meta.get("max"), meta.get("codec")


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize(
    ("topic", "code"),
    [
        ("results", None),  # the output topic: always
        ("dgstream.replies.ab12", None),  # the default allow-list
        ("other", ErrorCode.REPLY_TOPIC_NOT_ALLOWED),
        ("__consumer_offsets", ErrorCode.REPLY_TOPIC_NOT_ALLOWED),
        ("__transaction_state", ErrorCode.REPLY_TOPIC_NOT_ALLOWED),
        ("requests", ErrorCode.REPLY_TOPIC_NOT_ALLOWED),  # a loop through the pipeline
        ("dead", ErrorCode.REPLY_TOPIC_NOT_ALLOWED),
    ],
)
def test_the_allow_list(topic: str, code: ErrorCode | None) -> None:
    guard = TopicGuard(_settings(), Cluster().describe)
    refusal = guard.by_name(topic)
    assert (refusal.code if refusal else None) == code
    if refusal is not None:
        assert refusal.field == "reply_topic" and topic in refusal.message


def test_an_allow_list_of_patterns_and_internal_topics_even_when_listed() -> None:
    guard = TopicGuard(_settings(reply_topics=["team-*", "__*"]), Cluster().describe)
    assert guard.by_name("team-a") is None
    refusal = guard.by_name("__consumer_offsets")
    assert refusal is not None and "internal" in refusal.message


def test_what_the_cluster_says_is_kept_good_forever_bad_for_a_while() -> None:
    cluster, clock = Cluster(), Clock()
    cluster.add("dgstream.replies.ok")
    cluster.add("dgstream.replies.ro", ops=["READ", "DESCRIBE"])
    guard = TopicGuard(_settings(), cluster.describe, clock)
    ok = guard.lookup("dgstream.replies.ok")
    assert ok is not None and ok.refusal is None
    assert ok.limit == Limit(1_048_576, 1_048_588, "producer")
    known = guard.lookup("dgstream.replies.nope")
    missing = known.refusal if known else None
    assert missing is not None and missing.code == ErrorCode.REPLY_TOPIC_UNKNOWN
    known = guard.lookup("dgstream.replies.ro")
    ro = known.refusal if known else None
    assert ro is not None and ro.code == ErrorCode.REPLY_TOPIC_NOT_WRITABLE
    assert guard.cached("dgstream.replies.ok") is not None
    known = guard.cached("dgstream.replies.nope")
    assert known is not None and known.refusal == missing
    clock.now += BAD_TTL_S + 1  # it may have been created since
    assert guard.cached("dgstream.replies.nope") is None
    assert guard.cached("dgstream.replies.ok") is not None
    assert cluster.asked.count("dgstream.replies.ok") == 1


def test_a_question_that_fails_refuses_nothing_and_is_asked_again_a_minute_later() -> None:
    def down(topic: str) -> tuple[dict[str, Any], int | None, str | None]:
        raise TimeoutError("the cluster is out of reach")

    clock = Clock()
    guard = TopicGuard(_settings(), down, clock)
    assert guard.due("dgstream.replies.x")
    assert guard.lookup("dgstream.replies.x") is None
    assert guard.cached("dgstream.replies.x") is None
    # A flood of records meanwhile does not ask again; a minute later, or a refused send,
    # does.
    assert not guard.due("dgstream.replies.x")
    clock.now += BAD_TTL_S + 1
    assert guard.due("dgstream.replies.x")
    guard.lookup("dgstream.replies.x")
    guard.forget("dgstream.replies.x")
    assert guard.due("dgstream.replies.x")


def test_a_record_must_fit_the_producer_and_the_topic_each_by_its_own_measure() -> None:
    """The producer compares kafka-python's estimate with max_request_size; the broker the
    record's batch with max.message.bytes (and a topic's own codec may grow it)."""
    cluster = Cluster()
    cluster.add("results", max_bytes=2_000)
    cluster.add("squeezed", max_bytes=2_000, codec="gzip")
    guard = TopicGuard(_settings(producer={"max_request_size": 1_500_000}), cluster.describe)
    guard.lookup("results")
    guard.lookup("squeezed")
    headers: list[tuple[str, bytes | None]] = [("schema_version", b"1"), ("worker", b"w")]

    def value_for(size: int) -> bytes:  # a value whose lone batch is `size` bytes
        n = size - batch_size(b"id", b"", headers) - 4  # below: a length takes up to 4 more
        while batch_size(b"id", b"x" * n, headers) < size:
            n += 1
        assert batch_size(b"id", b"x" * n, headers) == size
        return b"x" * n

    limit = guard.limit("results")
    assert limit.fits(b"id", value_for(2_000), headers)
    assert not limit.fits(b"id", value_for(2_001), headers)
    # The estimate counts up to 18 bytes more than the lone batch: it is not what the
    # broker compares (an estimate of 2,000 is a batch of 1,985).
    assert record_size(b"id", value_for(2_000), headers) > 2_000
    # gzip on the broker: deflate's and gzip's framing on top.
    assert not guard.limit("squeezed").fits(b"id", value_for(2_000), headers)
    assert guard.limit("squeezed").fits(b"id", value_for(1_900), headers)
    # A topic never asked about: the producer's own limit, by its estimate.
    never = guard.limit("dead")
    assert never == Limit(1_500_000) and never.batch is None
    assert never.max_size_of == 1_500_000 - record_size(None, None, []) + 3


# --------------------------------------------------------------------------- poison


def test_attempts_survive_the_metadata_string_and_foreign_metadata_counts_nothing() -> None:
    a = Attempts(started=3, alone=1)
    assert parse_attempts(a.text()) == a
    assert Attempts().text() == ""
    for foreign in (None, "", "checkpoint-17", "dgstream:v1;started=x;alone=1"):
        assert parse_attempts(foreign) == Attempts()


def _guard() -> PoisonGuard:
    return PoisonGuard(PoisonTuning(suspect_after=2, poison_after=2), window=4)


def test_a_partition_first_seen_counts_one_start() -> None:
    g = _guard()
    assert g.first_seen(TP, 10, 10, "") == (10, "dgstream:v1;started=1;alone=0")
    assert not g.careful()
    # Progress: the commit itself says PROGRESS (this incarnation's start at 14), which a
    # clean leave clears and a death leaves for the next owner to count.
    g.committed(TP, 14)
    assert g.write_back({TP}) == {TP: (14, "")}
    assert g.write_back({TP}) == {}  # once
    assert _guard().first_seen(TP, 14, 14, PROGRESS) == (14, Attempts(2, 0).text())


def test_progress_carries_the_count_within_the_window_with_this_start() -> None:
    """Deaths counted at 10 had records from 10 in flight (the window: 4 here): a commit
    of 12 says they happened after 12 as far as anyone knows, plus this incarnation's
    start; from 14 on, only this start. A clean leave takes this start out again."""
    g = _guard()
    g.first_seen(TP, 10, 10, Attempts(1, 0).text())
    assert g.progress(TP, 12) == Attempts(2, 0).text()
    g.committed(TP, 12)
    assert g.write_back({TP}) == {TP: (12, Attempts(1, 0).text())}
    assert g.progress(TP, 14) == PROGRESS
    g.committed(TP, 14)
    assert g.write_back({TP}) == {TP: (14, "")}
    # The next owner, after a death at 12, counts both deaths there.
    assert _guard().first_seen(TP, 12, 12, Attempts(2, 0).text()) == (12, Attempts(3, 0).text())
    # A suspect partition's commits keep it suspect until its one-at-a-time run is through.
    g = _guard()
    g.first_seen(TP, 10, 10, Attempts(0, 1).text())
    assert g.careful() and g.progress(TP, 11) == Attempts(2, 0).text()
    assert g.progress(TP, 14) == PROGRESS
    assert g.progress(T_OTHER, 3) == PROGRESS  # a partition it never saw


def test_a_committed_offset_not_where_reading_starts_counts_from_zero() -> None:
    g = _guard()
    old = Attempts(5, 5).text()
    assert g.first_seen(TP, 20, 10, old) == (20, Attempts(1, 0).text())
    assert not g.careful() and g.poison(TP, 20) is None


def test_two_crashed_starts_make_the_partition_suspect_and_records_run_alone() -> None:
    g = _guard()
    g.first_seen(TP, 10, 10, Attempts(2, 0).text())
    assert g.careful() and g.suspect(TP)
    assert g.before_alone(TP, 10) == (10, Attempts(3, 1).text())
    assert g.before_alone(TP, 10) is None  # counted once per incarnation (outage retries)
    g.committed(TP, 11)  # the two deaths are carried to 11 (within the window)
    assert g.before_alone(TP, 11) == (11, Attempts(3, 1).text())
    g.committed(TP, 14)  # the window (4 records) is through
    assert not g.careful()


def test_a_record_alone_in_two_crashes_is_poison() -> None:
    g = _guard()
    g.first_seen(TP, 12, 12, Attempts(1, 1).text())
    assert g.careful() and g.poison(TP, 12) is None  # once alone: once more
    g = _guard()
    g.first_seen(TP, 12, 12, Attempts(1, 2).text())
    assert g.poison(TP, 12) == Attempts(1, 2)
    assert g.poison(TP, 13) is None


def test_leaving_cleanly_without_progress_writes_back_what_was_read() -> None:
    g = _guard()
    seen = Attempts(1, 0).text()
    g.first_seen(TP, 10, 10, seen)
    assert g.write_back({TP}) == {TP: (10, seen)}
    assert g.write_back({TP}) == {}  # once


def test_a_partition_given_back_cleanly_counts_the_next_owners_death_when_it_returns() -> None:
    """Two workers: this one gives the partition away cleanly (its count written back), the
    other counts its own start there and dies; back here, that death is counted."""
    g = _guard()
    assert g.first_seen(TP, 10, 10, "") == (10, Attempts(1, 0).text())
    assert g.write_back({TP}) == {TP: (10, "")}
    g.forget({TP})
    assert g.first_seen(TP, 10, 10, Attempts(1, 0).text()) == (10, Attempts(2, 0).text())
    g = _guard()  # the same for a record it ran alone
    g.first_seen(TP, 10, 10, Attempts(2, 0).text())
    assert g.before_alone(TP, 10) == (10, Attempts(3, 1).text())
    assert g.write_back({TP}) == {TP: (10, Attempts(2, 0).text())}
    g.forget({TP})
    g.first_seen(TP, 10, 10, Attempts(3, 1).text())
    assert g.before_alone(TP, 10) == (10, Attempts(4, 2).text())


def test_a_suspect_partition_handed_over_mid_window_stays_suspect() -> None:
    """Two crashes made the partition suspect; its first record ran alone and committed;
    a rebalance hands it over before the window (4 records) is through: the next owner
    still runs its records one at a time, so the crashing one is caught alone."""
    g = _guard()
    g.first_seen(TP, 10, 10, Attempts(2, 0).text())
    g.before_alone(TP, 10)
    g.committed(TP, 11)
    assert g.careful()
    (mark,) = g.write_back({TP}).values()
    assert mark == (11, Attempts(2, 0).text())
    nxt = _guard()
    nxt.first_seen(TP, 11, 11, mark[1])
    assert nxt.suspect(TP)
    g = _guard()  # through the window: nothing to carry
    g.first_seen(TP, 10, 10, Attempts(2, 0).text())
    g.committed(TP, 14)
    assert not g.careful() and g.write_back({TP}) == {TP: (14, "")}


def test_a_partition_that_leaves_and_comes_back_is_not_counted_twice() -> None:
    """A rebalance moves a partition away and back within one incarnation: one start."""
    g = _guard()
    assert g.first_seen(TP, 10, 10, "") == (10, Attempts(1, 0).text())
    g.forget({TP})
    assert g.first_seen(TP, 10, 10, Attempts(1, 0).text()) == (10, Attempts(1, 0).text())
    assert not g.careful()

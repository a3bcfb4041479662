"""Kafka admin helpers: a consumer group's lag (the autoscaler's signal) and topic setup;
and `subscribe_known`, the one way this project's group consumers subscribe.

Every admin function takes `target`: a `KafkaAdminClient` (used as is, left open), a
`KafkaConnection`, or bootstrap servers (a "host:port[,host:port]" string or a list), from
which a short-lived admin client is made and closed.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, Literal, TypeAlias, TypeVar

from kafka import IsolationLevel, KafkaAdminClient, OffsetSpec, TopicPartition
from kafka.errors import (
    KafkaError,
    KafkaTimeoutError,
    TopicAlreadyExistsError,
    UnknownTopicOrPartitionError,
)

from dgstream.workers.kafka.settings import KafkaConnection

__all__ = [
    "AdminTarget",
    "admin_client",
    "compute_lag",
    "ensure_topics",
    "partitions_for",
    "total_lag",
]

_T = TypeVar("_T")
AdminTarget: TypeAlias = "KafkaAdminClient | KafkaConnection | str | list[str]"


@contextlib.contextmanager
def admin_client(target: AdminTarget, **kwargs: Any) -> Iterator[Any]:
    """An admin client for `target`; closed on exit unless it was passed in."""
    if isinstance(target, KafkaAdminClient):
        yield target
        return
    if isinstance(target, KafkaConnection):
        conn = target
    else:
        conn = KafkaConnection(bootstrap_servers=target)
    admin = KafkaAdminClient(**conn.client_kwargs(**kwargs))
    try:
        yield admin
    finally:
        admin.close()


def partitions_for(admin: Any, topics: Iterable[str]) -> list[TopicPartition]:
    """Every partition of `topics` (raises UnknownTopicOrPartitionError for a missing one)."""
    names = sorted(set(topics))
    if not names:
        return []
    described = admin.describe_topics(names)
    by_name = {t["name"]: t for t in described}
    out: list[TopicPartition] = []
    for name in names:
        t = by_name.get(name)
        if t is None or t.get("error_code", 0) != 0 or not t.get("partitions"):
            raise UnknownTopicOrPartitionError(f"topic {name!r} is unknown to the cluster")
        out.extend(TopicPartition(name, p["partition_index"]) for p in t["partitions"])
    return sorted(out)


def compute_lag(
    target: AdminTarget,
    group: str,
    topics: Iterable[str],
    *,
    isolation_level: Literal["read_uncommitted", "read_committed"] = "read_uncommitted",
    timeout_s: float = 30.0,
) -> dict[TopicPartition, int]:
    """Per partition of `topics`: end offset minus the group's committed offset.

    A partition the group never committed counts from its beginning offset (everything in
    it is backlog), as does one whose committed offset fell below the beginning (retention
    removed records; a consumer restarts from the beginning there). Use
    `read_committed` for consumers of transactional producers: the end is then the last
    stable offset. Retriable errors (the group coordinator still loading, e.g. on a fresh
    cluster) are retried for up to `timeout_s`.
    """
    with admin_client(target) as admin:
        tps = partitions_for(admin, topics)
        if not tps:
            return {}
        level = (
            IsolationLevel.READ_COMMITTED
            if isolation_level == "read_committed"
            else IsolationLevel.READ_UNCOMMITTED
        )
        deadline = time.monotonic() + timeout_s
        committed_all = _retrying(
            lambda: admin.list_group_offsets({group: tps}).get(group, {}), deadline
        )
        ends = _retrying(
            lambda: admin.list_partition_offsets(
                {tp: OffsetSpec.LATEST for tp in tps}, isolation_level=level
            ),
            deadline,
        )
        begins = _retrying(
            lambda: admin.list_partition_offsets({tp: OffsetSpec.EARLIEST for tp in tps}),
            deadline,
        )
    lag: dict[TopicPartition, int] = {}
    for tp in tps:
        end = int(ends[tp].offset)
        begin = int(begins[tp].offset)
        meta = committed_all.get(tp)
        committed = int(meta.offset) if meta is not None and meta.offset is not None else -1
        start = max(committed, begin) if committed >= 0 else begin
        lag[tp] = max(0, end - start)
    return lag


def _retrying(call: Callable[[], _T], deadline: float) -> _T:
    """`call()`, again after a short pause while it raises a retriable Kafka error."""
    pause = 0.05
    while True:
        try:
            return call()
        except KafkaError as exc:
            if not getattr(exc, "retriable", False) or time.monotonic() + pause > deadline:
                raise
        time.sleep(pause)
        pause = min(pause * 2, 1.0)


def subscribe_known(consumer: Any, topics: Iterable[str], listener: Any = None) -> None:
    """`consumer.subscribe(topics)` once the consumer's metadata holds each topic's
    partitions. kafka-python 3 may send its first JoinGroup before its first metadata
    response; a leader then assigns from empty metadata, hands out nothing ("No partition
    metadata for topic ...") and stays idle until a metadata refresh (metadata_max_age_ms,
    5 minutes by default). CI hit it twice on 2026-11-30: the demo's worker, and the worker
    benchmark's plain loop. A topic that does not exist yet is subscribed all the same."""
    topics = list(topics)
    for topic in topics:
        consumer.partitions_for_topic(topic)  # fetches the cluster's metadata when unknown
    consumer.subscribe(topics, listener=listener)


def total_lag(lag: Mapping[TopicPartition, int]) -> int:
    return sum(lag.values())


def ensure_topics(
    target: AdminTarget,
    topics: Mapping[str, int] | Iterable[str],
    *,
    partitions: int = 1,
    replication_factor: int = -1,
    configs: Mapping[str, str] | None = None,
    grow_partitions: bool = False,
    timeout_s: float = 30.0,
) -> dict[str, int]:
    """Create the missing topics and wait until each has a leader for every partition.

    `topics` is a mapping name -> partition count, or names (each with `partitions`).
    `replication_factor=-1` takes the broker's default. An existing topic keeps its
    partitions; with `grow_partitions` it is grown to the asked count (never shrunk).
    Returns name -> partition count as the cluster now has it.
    """
    wanted: dict[str, int] = (
        dict(topics) if isinstance(topics, Mapping) else dict.fromkeys(topics, partitions)
    )
    if not wanted:
        return {}
    for name, count in wanted.items():
        if count < 1:
            raise ValueError(f"topic {name!r}: partitions must be at least 1")
    timeout_ms = int(timeout_s * 1000)
    with admin_client(target) as admin:
        existing = _partition_counts(admin, list(wanted))
        missing = {n: c for n, c in wanted.items() if n not in existing}
        if missing:
            spec = {
                name: {
                    "num_partitions": count,
                    "replication_factor": replication_factor,
                    "configs": dict(configs or {}),
                }
                for name, count in missing.items()
            }
            result = admin.create_topics(spec, timeout_ms=timeout_ms, raise_errors=False)
            for t in result.get("topics", []):
                code = t.get("error_code", 0)
                if code not in (0, TopicAlreadyExistsError.errno):
                    raise RuntimeError(
                        f"creating topic {t.get('name')!r} failed: error {code} "
                        f"{t.get('error_message') or ''}".rstrip()
                    )
        expect = dict.fromkeys(wanted, 1) | missing
        if grow_partitions:
            grow = {n: c for n, c in wanted.items() if n in existing and existing[n] < c}
            if grow:
                admin.create_partitions(grow, timeout_ms=timeout_ms)
                expect |= grow
        _wait_ready(admin, expect, time.monotonic() + timeout_s)
        return _partition_counts(admin, list(wanted))


def _partition_counts(admin: Any, names: list[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for t in admin.describe_topics(names):
        if t.get("error_code", 0) == 0 and t.get("partitions"):
            counts[t["name"]] = len(t["partitions"])
    return counts


def _wait_ready(admin: Any, expect: Mapping[str, int], deadline: float) -> None:
    """Until each topic has at least `expect[name]` partitions, each with a leader."""
    while True:
        by_name = {t["name"]: t for t in admin.describe_topics(list(expect))}
        if all(_topic_ready(by_name.get(name), count) for name, count in expect.items()):
            return
        if time.monotonic() > deadline:
            raise KafkaTimeoutError(f"topics not ready in time: {sorted(expect)}")
        time.sleep(0.05)


def _topic_ready(described: dict[str, Any] | None, min_partitions: int) -> bool:
    if described is None or described.get("error_code", 0) != 0:
        return False
    parts = described.get("partitions") or []
    return len(parts) >= min_partitions and all(
        p.get("error_code", 0) == 0 and p.get("leader_id", -1) >= 0 for p in parts
    )

"""kafka-python 3.0's behaviours the worker works around, in one place: every workaround that
reaches into the client's private state, and the bounds its calls lack.

Each function says what kafka-python does, where (its module), and what the workaround
does instead. A kafka-python without the private state one of them reads makes that
function do nothing (it never raises for a missing attribute): upgrading the client is
then a matter of checking whether the quirk is gone, here, one function at a time.
"""

from __future__ import annotations

from typing import Any

from kafka import TopicPartition
from kafka.errors import ProducerFencedError

__all__ = [
    "OFFSET_FETCH_TIMEOUT_MS",
    "committed_offset",
    "drop_refused_offsets",
    "fenced",
    "fetching_partition",
    "no_auto_create",
    "read_position",
    "rejoin_pending",
]

# A committed-offset lookup (one OffsetFetch round trip to the group coordinator) gives up
# after this long: kafka-python retries it without a bound while the coordinator is unknown
# or answers a retriable error (UNSTABLE_OFFSET_COMMIT while an open transaction holds
# offsets of the partition, until that transaction ends), and the consumer thread blocked
# there neither polls nor commits. 10 s: a quarter of the default session timeout (45 s),
# long against a round trip on a loaded loopback broker (milliseconds).
OFFSET_FETCH_TIMEOUT_MS = 10_000


def committed_offset(consumer: Any, tp: TopicPartition, *, metadata: bool = False) -> Any:
    """`consumer.committed(tp)`, bounded by OFFSET_FETCH_TIMEOUT_MS (raises KafkaError
    when it gives up). With `metadata`, the whole OffsetAndMetadata."""
    if metadata:
        return consumer.committed(tp, metadata=True, timeout_ms=OFFSET_FETCH_TIMEOUT_MS)
    return consumer.committed(tp, timeout_ms=OFFSET_FETCH_TIMEOUT_MS)


def no_auto_create(producer: Any) -> None:
    """kafka-python 3.0 drops the producer's allow_auto_create_topics (net/manager.py
    builds the cluster metadata without it), so its metadata requests ask the broker to
    create any topic they name: a reply_topic with a typo would be created. Set it where
    the requests read it."""
    config = getattr(getattr(producer, "_metadata", None), "config", None)
    if isinstance(config, dict) and "allow_auto_create_topics" in config:
        config["allow_auto_create_topics"] = False


def read_position(consumer: Any, tp: TopicPartition) -> int | None:
    """The offset of the next record the consumer would return from `tp`, as it knows it
    now; None when it knows none (not assigned, or awaiting a reset). kafka-python 3.0's
    `position()` first refreshes committed offsets and resets (round trips to the broker,
    consumer/group.py); the worker only wants the known value, which its fetcher moves past
    what it never returns: control batches (transaction markers) and, read committed,
    aborted records (consumer/fetcher.py, `_append`, also for a fetch that returned none)."""
    state = getattr(getattr(consumer, "_subscription", None), "assignment", {}).get(tp)
    if state is None or not state.has_valid_position:
        return None
    return int(state.position.offset)


def rejoin_pending(consumer: Any) -> bool:
    """Whether the consumer's group coordinator has a rejoin due. kafka-python 3.0 drives
    JoinGroup/SyncGroup from poll() only (coordinator/base.py, join_group_async: it takes a
    join's result only while a poll() waits on it, and sends a new JoinGroup when it
    finished meanwhile; a leader's new JoinGroup starts a new rebalance): knowing that one
    is due lets the loop poll long enough for it to finish inside one call."""
    coordinator = getattr(consumer, "_coordinator", None)
    need = getattr(coordinator, "need_rejoin", None)
    if need is None:
        return False
    try:
        return bool(need())
    except Exception:
        return False


def drop_refused_offsets(producer: Any) -> None:
    """Forget the offsets an earlier transaction left pending in kafka-python's transaction
    manager. kafka-python 3.0 removes a partition's pending offset only when the coordinator
    accepts it; offsets it refused (a stale member or generation) stay, the transaction is
    aborted, and the next transaction's TxnOffsetCommit sends them again with its own, so a
    transaction commits offsets of records it never read. By the time this transaction adds
    its offsets the earlier ones have ended (committed: none pending; aborted: stale)."""
    manager: Any = getattr(producer, "_transaction_manager", None)
    pending = getattr(manager, "_pending_txn_offset_commits", None)
    if pending:  # a kafka-python without this private state: nothing to drop
        with manager._lock:  # kafka-python's own, taken by its sender thread too
            pending.clear()


def fenced(producer: Any) -> bool:
    """Whether a transactional producer was fenced: kafka-python's transaction manager went
    fatal with ProducerFencedError (another producer initialised the same transactional
    id). kafka-python says so only in its private state; the refusals it raises after that
    are plain KafkaErrors naming the error in their text."""
    manager = getattr(producer, "_transaction_manager", None)
    error = getattr(manager, "last_error", None)
    return isinstance(error, ProducerFencedError) or error is ProducerFencedError


def fetching_partition(consumer: Any) -> tuple[str, int] | None:
    """The partition whose record batch kafka-python's fetcher was unpacking when a poll
    raised (a batch it cannot read: `workers.poll_errors`). kafka-python 3.0 says so only in
    its fetcher's private state (the records in line, or the exception it holds for them);
    None when neither names one."""
    fetcher = getattr(consumer, "_fetcher", None)
    for attr in ("_next_partition_records", "_next_in_line_exception_metadata"):
        held = getattr(fetcher, attr, None)
        tp = getattr(held, "topic_partition", None) or getattr(held, "partition", None)
        if tp is not None and hasattr(tp, "topic"):
            return str(tp.topic), int(tp.partition)
    return None

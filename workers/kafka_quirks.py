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
    "bound_batches",
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


def bound_batches(consumer: Any, batch_bytes: int, value_bytes: int) -> bool:
    """Bound the memory one record batch costs the consumer. kafka-python 3.0 decompresses
    a batch whole, however large (record/default_records.py, `_maybe_uncompress`, through
    kafka/codec.py's decoders), and copies each value out of it whole (`_read_msg`): 19 KB
    of zstd became 200 MB, then copies of it. From this call on, the consumer's fetcher
    (`consumer._fetcher.PartitionRecords`, the class it builds for each fetched partition)
    reads every v2 batch through `workers.decompress`, in chunks:

    * a batch that decompresses past `batch_bytes` is not read: one record stands for it,
      at its last offset (so the partition's position moves past the batch, as reading it
      would have), without key or headers, its value an `UnreadBatch` saying where it is;
    * a value longer than `value_bytes` is kept as a `CutValue`: its first `value_bytes`
      bytes and its size.

    Returns whether the bound is in place (False: a kafka-python without that private
    state, or a consumer bounded already). Legacy batches (magic 0 and 1, which Kafka 4
    brokers no longer serve) and lz4 read through lz4f or lz4framed keep kafka-python's
    unbounded reading."""
    from kafka.record.default_records import DefaultRecordBatch

    fetcher: Any = getattr(consumer, "_fetcher", None)
    base: Any = getattr(fetcher, "PartitionRecords", None)
    if not isinstance(base, type) or getattr(base, "_dgstream_bounded", False):
        return False
    # The batch's private state `_BoundedBatch` reads and writes.
    slots = set(getattr(DefaultRecordBatch, "__slots__", ()))
    if not {"_buffer", "_pos", "_decompressed"} <= slots or not (
        hasattr(DefaultRecordBatch, "_assert_has_codec")
    ):
        return False
    parent: Any = base

    def init(self: Any, fetch_offset: int, tp: Any, records: Any, *args: Any, **kw: Any) -> None:
        bounded = _BoundedRecords(records, batch_bytes, value_bytes)
        parent.__init__(self, fetch_offset, tp, bounded, *args, **kw)

    members = {"__init__": init, "_dgstream_bounded": True}
    # An instance attribute: this consumer's fetcher only, not kafka-python's class.
    fetcher.PartitionRecords = type("BoundedPartitionRecords", (base,), members)
    return True


class _BoundedRecords:
    """A fetched partition's MemoryRecords whose v2 batches read within the bounds."""

    __slots__ = ("_batch_bytes", "_records", "_value_bytes")

    def __init__(self, records: Any, batch_bytes: int, value_bytes: int) -> None:
        self._records, self._batch_bytes, self._value_bytes = records, batch_bytes, value_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._records, name)

    def next_batch(self, *args: Any, **kw: Any) -> Any:
        batch = self._records.next_batch(*args, **kw)
        if batch is None or getattr(batch, "magic", None) != 2:
            return batch
        return _BoundedBatch(batch, self._batch_bytes, self._value_bytes)


class _BoundedBatch:
    """A v2 record batch (kafka-python's DefaultRecordBatch) iterated within the bounds;
    everything else is the batch's own."""

    __slots__ = ("_batch", "_batch_bytes", "_value_bytes")

    def __init__(self, batch: Any, batch_bytes: int, value_bytes: int) -> None:
        self._batch, self._batch_bytes, self._value_bytes = batch, batch_bytes, value_bytes

    def __getattr__(self, name: str) -> Any:
        return getattr(self._batch, name)

    def __next__(self) -> Any:  # the fetcher reads a control batch's marker this way
        return next(self._batch)

    def __iter__(self) -> Any:
        from workers.decompress import OverBound, UnreadBatch, decompress

        batch = self._batch
        codec = batch.compression_type
        if not batch._decompressed and codec != batch.CODEC_NONE:
            batch._assert_has_codec(codec)  # kafka-python's refusal of a missing library
            with memoryview(batch._buffer) as whole, whole[batch._pos :] as data:
                try:
                    out = decompress(codec, data, self._batch_bytes)
                except OverBound:
                    from kafka.record.default_records import DefaultRecord

                    value = UnreadBatch.of(batch, self._batch_bytes)
                    return iter(
                        [
                            DefaultRecord(
                                batch.size_in_bytes,
                                batch.last_offset,
                                batch.max_timestamp,
                                batch.timestamp_type,
                                None,
                                value,
                                [],
                            )
                        ]
                    )
            if out is not None:  # else kafka-python decompresses it (unbounded)
                batch._buffer, batch._pos, batch._decompressed = out, 0, True
        return self._cut(iter(batch))

    def _cut(self, records: Any) -> Any:
        from workers.decompress import CutValue

        keep = self._value_bytes
        for record in records:
            value = record.value
            if value is not None and len(value) > keep and hasattr(record, "_value"):
                record._value = CutValue.of(value, keep)
            yield record

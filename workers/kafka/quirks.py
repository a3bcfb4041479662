"""kafka-python 3.0's behaviours the worker works around, in one place: every workaround that
reaches into the client's private state, and the bounds its calls lack.

Each function says what kafka-python does, where (its module), and what the workaround
does instead. A kafka-python without the private state one of them reads makes that
function do nothing (it never raises for a missing attribute): upgrading the client is
then a matter of checking whether the quirk is gone, here, one function at a time.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

from kafka import TopicPartition
from kafka.errors import ProducerFencedError
from kafka.structs import MemberState

from dgstream.schemas.headers import HeaderKey, java_text

__all__ = [
    "OFFSET_FETCH_TIMEOUT_MS",
    "HeaderKey",
    "bound_batches",
    "committed_offset",
    "drop_refused_offsets",
    "fenced",
    "fetching_partition",
    "held_back",
    "install",
    "java_text",
    "keep_finished_joins",
    "keep_unread_errors",
    "no_auto_create",
    "read_any_header_key",
    "read_position",
    "rejoin_pending",
    "take_finished_join",
    "unpark_resumed",
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
    """Whether this member is not settled in its group: a rejoin is due, or a join is under
    way (kafka-python's member state is not STABLE). kafka-python 3.0 drives
    JoinGroup/SyncGroup from poll() only (coordinator/base.py, join_group_async), and
    refuses an offset commit on the client side while the member is rebalancing
    (coordinator/consumer.py raises RebalanceInProgressError: "try completing the
    rebalance by calling poll()"): while this holds, the loop polls long enough for the
    join and commits nothing. A consumer without a group coordinator is always settled."""
    coordinator = getattr(consumer, "_coordinator", None)
    need = getattr(coordinator, "need_rejoin", None)
    if need is None:
        return False
    try:
        if bool(need()):
            return True
        state = getattr(coordinator, "state", None)
        return state is not None and state is not _STABLE
    except Exception:
        return False


# kafka-python's MemberState values (kafka/structs.py): strings that kafka-python compares
# by identity (`state is MemberState.STABLE`), so these must be its own objects.
_STABLE: Any = getattr(MemberState, "STABLE", None)
_REBALANCING: Any = getattr(MemberState, "REBALANCING", None)


def keep_finished_joins() -> None:
    """Make kafka-python take a join that finished between two polls instead of dropping it.

    kafka-python 3.0 runs a member's JoinGroup -> SyncGroup as a task of its I/O loop and
    reads the task's result only while a poll() waits on it (coordinator/base.py,
    join_group_async). When the task finished meanwhile, the next poll finds it done and
    sends a NEW JoinGroup without reading it: the assignment it carried is lost and, from
    the group's leader, the new JoinGroup starts a new rebalance for every member. A member
    whose polls are short or far apart (its consumer thread busy, or starved of the GIL by
    a model on the CPU) then never settles: each join finishes between polls and is
    replaced, the generation climbs, and every offset commit is refused as
    RebalanceInProgressError (seen on 2026-12-07: thousands a minute, nothing answered).
    Java's consumer keeps the finished join for the next poll; so does this.

    The wrapper runs before kafka-python's own join_group_async: a join task that finished
    with an assignment while the member is still rebalancing is taken as a waiting poll
    would take it (the member becomes STABLE, heartbeats resume, the assignment and the
    rebalance listener run); anything else (no task, one still running, one that failed,
    a member whose generation was reset meanwhile) goes to kafka-python as before.

    And a poll must get there at all: kafka-python joins only while `need_rejoin()` holds,
    and a rejoin that the metadata asked for (the leader's assignment snapshot behind the
    topic's partitions) stops being needed once the leader has made the new assignment,
    inside the join task, before the member has taken it. The member then stayed
    REBALANCING with its heartbeat off until its session expired, committing nothing,
    for good (seen on 2026-12-07 under load: 3 in 4 runs of a test with four copies at
    once). The same holds when a join attempt fails with a retriable error after the
    leader's assignment. So `need_rejoin` says True while the member is REBALANCING:
    kafka-python then takes the join in hand, or starts one.
    Process-wide and idempotent; a kafka-python without this private state is left alone."""
    from kafka.coordinator.base import BaseCoordinator

    _keep_joins_needed()

    original = getattr(BaseCoordinator, "join_group_async", None)
    if original is None or getattr(original, "_dgstream_keeps_joins", False):
        return
    with _PATCH_LOCK:
        if getattr(BaseCoordinator.join_group_async, "_dgstream_keeps_joins", False):
            return

        @functools.wraps(original)
        async def join_group_async(self: Any, timeout_ms: Any = None) -> Any:
            if await take_finished_join(self):
                return True
            return await original(self, timeout_ms)

        join_group_async._dgstream_keeps_joins = True  # type: ignore[attr-defined]
        BaseCoordinator.join_group_async = join_group_async


_PATCH_LOCK = threading.Lock()


def _keep_joins_needed() -> None:
    """`keep_finished_joins`' second half: ConsumerCoordinator.need_rejoin is True while
    the member is REBALANCING (a join running, finished and not taken yet, or given up),
    whatever else it says."""
    from kafka.coordinator.consumer import ConsumerCoordinator

    original = getattr(ConsumerCoordinator, "need_rejoin", None)
    if original is None or getattr(original, "_dgstream_keeps_joins", False):
        return
    with _PATCH_LOCK:
        if getattr(ConsumerCoordinator.need_rejoin, "_dgstream_keeps_joins", False):
            return

        @functools.wraps(original)
        def need_rejoin(self: Any) -> bool:
            if getattr(self, "state", None) is _REBALANCING:
                return True
            return bool(original(self))

        need_rejoin._dgstream_keeps_joins = True  # type: ignore[attr-defined]
        ConsumerCoordinator.need_rejoin = need_rejoin


async def take_finished_join(coordinator: Any) -> bool:
    """`keep_finished_joins`' step: when the member's join task finished with an
    assignment while the member still rebalances, take it as kafka-python's waiting poll
    would (the member STABLE, its heartbeat on, the assignment applied and the rebalance
    listener run) and return True; otherwise change nothing and return False."""
    task = getattr(coordinator, "_join_task", None)
    if (
        task is None
        or not getattr(task, "is_done", False)
        or not task.succeeded()
        or getattr(coordinator, "state", None) is not _REBALANCING
    ):
        return False
    with coordinator._lock:
        coordinator._join_task = None
        coordinator.rejoining = False
        coordinator.rejoin_needed = False
        coordinator.state = _STABLE
        coordinator._enable_heartbeat()
    generation = coordinator._generation
    await coordinator._on_join_complete_async(
        generation.generation_id, generation.member_id, generation.protocol, task.value
    )
    return True


def held_back(consumer: Any, hog: TopicPartition) -> set[TopicPartition]:
    """The assigned partitions other than `hog` whose reading waits while `hog`'s fetched
    records are handed out. kafka-python 3.0 (consumer/fetcher.py) keeps fetch responses
    in `_completed_fetches`, one partition each, and drains them one partition at a time;
    it fetches no partition that has a response in line, empty or not, and sends no new
    fetch at all while any response is in line (`fetch_records` sends only when nothing
    is buffered beyond the records in hand). So while a flood's records are handed out,
    another partition is held back when its response waits in line, or when no fetch is
    in flight to its leader (its new records are not even asked for), or when its records
    were parked while it was paused (they come back only once no other partition's records
    are in line). An empty set on a kafka-python without this private state."""
    fetcher = getattr(consumer, "_fetcher", None)
    line = getattr(fetcher, "_completed_fetches", None)
    pending = getattr(fetcher, "_nodes_with_pending_fetch_requests", None)
    subscription = getattr(consumer, "_subscription", None)
    if line is None or pending is None or subscription is None:
        return set()
    queued = {getattr(c, "topic_partition", None) for c in list(line)}
    queued |= set(getattr(fetcher, "_paused_partition_records", None) or ())
    queued |= set(getattr(fetcher, "_paused_completed_fetches", None) or ())
    cluster = getattr(getattr(fetcher, "_manager", None), "cluster", None)
    out: set[TopicPartition] = set()
    try:
        others = [tp for tp in subscription.fetchable_partitions() if tp != hog]
    except Exception:
        return set()
    for tp in others:
        unfetched = cluster is not None and cluster.leader_for_partition(tp) not in pending
        if tp in queued or unfetched:
            out.add(tp)
    return out


def unpark_resumed(consumer: Any) -> None:
    """Let a resumed partition's parked records come back. kafka-python 3.0's fetcher parks
    the records of a partition paused while they were in line, and gives them back only
    when nothing else is in line (consumer/fetcher.py, fetched_records: `_next_partition_
    records is None`); a partition whose records were all returned leaves its drained
    (empty) records object there, never None, so a parked partition would never be handed
    back, and is never fetched again while it holds parked records: it stalls for good.
    A drained object carries nothing: clearing it changes nothing else. Call after
    resume()."""
    fetcher = getattr(consumer, "_fetcher", None)
    in_line = getattr(fetcher, "_next_partition_records", None)
    if in_line is not None and not in_line:
        fetcher._next_partition_records = None  # type: ignore[union-attr]


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
    raised (a batch it cannot read: `workers.faults.poll_errors`). kafka-python 3.0 says so only in
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
    reads every v2 batch through `workers.kafka.decompress`, in chunks:

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
        from dgstream.workers.kafka.decompress import OverBound, UnreadBatch, decompress

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
        from dgstream.workers.kafka.decompress import CutValue

        keep = self._value_bytes
        for record in records:
            value = record.value
            if value is not None and len(value) > keep and hasattr(record, "_value"):
                record._value = CutValue.of(value, keep)
            yield record


# --------------------------------------------------------------------------- header keys


def read_any_header_key() -> None:
    """Make kafka-python read a record whose header key is not UTF-8 instead of failing the
    whole batch. kafka-python 3.0 decodes each header key strictly (record/
    default_records.py, `_read_msg`), so one such record raises CorruptRecordError for
    its batch, the poll raises, and the partition stops there (seen on 2026-12-07:
    librdkafka lets a producer write such a key; the worker filed it CORRUPT_BATCH and
    only `dgstream skip-batch` moved the partition on). Kafka's Java consumer reads it,
    replacing the bad bytes.

    kafka-python's own reader still reads every record; only a record it refused for a
    header key's bytes is read again here, from where it starts, by `_read_record` (the
    v2 record format, with the key as a `HeaderKey`). Process-wide and idempotent; a
    kafka-python whose record batch lacks this private state is left alone."""
    from kafka.record.default_records import DefaultRecordBatch

    original = getattr(DefaultRecordBatch, "__next__", None)
    if original is None or getattr(original, "_dgstream_any_header_key", False):
        return
    if not hasattr(DefaultRecordBatch, "_read_msg"):
        return  # another reader than the one this was written against
    with _PATCH_LOCK:
        if getattr(DefaultRecordBatch.__next__, "_dgstream_any_header_key", False):
            return

        @functools.wraps(original)
        def __next__(self: Any) -> Any:
            pos, index = self._pos, self._next_record_index
            try:
                return original(self)
            except Exception as exc:
                if not isinstance(exc.__context__, UnicodeDecodeError):
                    raise
            self._pos = pos
            record = _read_record(self)
            self._next_record_index = index + 1
            return record

        __next__._dgstream_any_header_key = True  # type: ignore[attr-defined]
        DefaultRecordBatch.__next__ = __next__
        DefaultRecordBatch.next = __next__


def _read_record(batch: Any) -> Any:
    """One record of a v2 record batch at `batch._pos` (Kafka's record format: length,
    attributes, timestamp delta, offset delta, key, value, headers; lengths and deltas are
    zigzag varints, a length of -1 is null), header keys of any bytes; moves `_pos` past
    it. Raises CorruptRecordError where the record does not add up, as kafka-python does."""
    from kafka.errors import CorruptRecordError
    from kafka.record.default_records import ControlRecord, DefaultRecord
    from kafka.record.util import decode_varint

    buffer, pos = batch._buffer, batch._pos
    length, pos = decode_varint(buffer, pos)
    start = pos
    pos += 1  # attributes: one byte, unused
    timestamp_delta, pos = decode_varint(buffer, pos)
    offset_delta, pos = decode_varint(buffer, pos)

    def nullable(at: int) -> tuple[bytes | None, int]:
        size, at = decode_varint(buffer, at)
        if size < 0:
            return None, at
        if at + size > len(buffer):
            raise CorruptRecordError(f"a record field of {size} bytes runs past its batch")
        return bytes(buffer[at : at + size]), at + size

    key, pos = nullable(pos)
    value, pos = nullable(pos)
    count, pos = decode_varint(buffer, pos)
    if count < 0:
        raise CorruptRecordError(f"a record with {count} headers")
    headers: list[tuple[str, bytes | None]] = []
    for _ in range(count):
        raw_key, pos = nullable(pos)
        if raw_key is None:
            raise CorruptRecordError("a record header with a null key")
        try:
            name: str = raw_key.decode("utf-8")
        except UnicodeDecodeError:
            name = HeaderKey(raw_key)
        header_value, pos = nullable(pos)
        headers.append((name, header_value))
    if pos - start != length:
        raise CorruptRecordError(f"a record of {length} bytes whose fields take {pos - start}")
    batch._pos = pos
    timestamp = (
        batch.max_timestamp
        if batch.timestamp_type == batch.LOG_APPEND_TIME
        else batch.first_timestamp + timestamp_delta
    )
    kind = ControlRecord if batch.is_control_batch else DefaultRecord
    return kind(
        length,
        batch.base_offset + offset_delta,
        timestamp,
        batch.timestamp_type,
        key,
        value,
        headers,
    )


def keep_unread_errors() -> None:
    """Never lose the error of a record batch the consumer cannot read.

    kafka-python 3.0 (consumer/fetcher.py, fetched_records) hands out the records before a
    batch it cannot read (a failed CRC, a codec it lacks) and keeps the error for the next
    call. That call raises it only if the partition is still fetchable at the same
    position; otherwise (paused meanwhile, as the worker's backpressure pauses every
    partition, or sought elsewhere) it drops the error, while the records object that met
    it stays in line, used up but never drained, and the next fetched_records that reaches
    it loops on it for ever: poll() never returns. The worker's consumer thread spun at
    100% CPU inside poll(), its offset at the bad batch, no error and no restart (seen on
    2026-12-07 in 2 of 4 runs of a pool whose input ended at such a batch). Draining that
    records object whenever the error is dropped makes the partition be fetched again from
    its position, so the same batch raises the same error where the worker can see it
    (once the partition is resumed, at that position). Process-wide and idempotent."""
    from kafka.consumer.fetcher import Fetcher

    original = getattr(Fetcher, "fetched_records", None)
    if original is None or getattr(original, "_dgstream_keeps_errors", False):
        return
    with _PATCH_LOCK:
        if getattr(Fetcher.fetched_records, "_dgstream_keeps_errors", False):
            return

        @functools.wraps(original)
        def fetched_records(self: Any, *args: Any, **kwargs: Any) -> Any:
            held = getattr(self, "_next_in_line_exception_metadata", None)
            if held is not None and not _raised_next(self, held):
                _drain_partition(self, held.partition)
            return original(self, *args, **kwargs)

        fetched_records._dgstream_keeps_errors = True  # type: ignore[attr-defined]
        Fetcher.fetched_records = fetched_records


def _raised_next(fetcher: Any, held: Any) -> bool:
    """Whether kafka-python's next fetched_records raises the error it holds (its own test)."""
    subscriptions, tp = fetcher._subscriptions, held.partition
    try:
        return bool(
            subscriptions.is_fetchable(tp)
            and subscriptions.position(tp).offset == held.fetched_offset
        )
    except (KeyError, AttributeError):  # no longer assigned: nothing to keep
        return False


def _drain_partition(fetcher: Any, tp: Any) -> None:
    """Drain `tp`'s records in line or parked: it is fetched again from its position."""
    in_line = getattr(fetcher, "_next_partition_records", None)
    if in_line is not None and getattr(in_line, "topic_partition", None) == tp:
        in_line.drain()
    parked = getattr(fetcher, "_paused_partition_records", {}).pop(tp, None)
    if parked is not None:
        parked.drain()


def install() -> None:
    """The process-wide workarounds every kafka-python client of dgstream needs
    (`keep_finished_joins`, `keep_unread_errors`, `read_any_header_key`); idempotent."""
    keep_finished_joins()
    keep_unread_errors()
    read_any_header_key()

"""Stand-ins for kafka-python's consumer and transactional producer, for broker-free tests
of the code that drives them (the committers). Each records the calls it gets, in order,
in one shared `events` list, and fails on demand (`fail[name] = exception`)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kafka import TopicPartition
from kafka.structs import OffsetAndMetadata


@dataclass
class GroupMetadata:
    """What `KafkaConsumer.group_metadata()` returns (the fields the committers read)."""

    group_id: str = "g"
    generation_id: int = 1
    member_id: str = "member-1"
    group_instance_id: str | None = None


@dataclass
class Calls:
    events: list[tuple[Any, ...]] = field(default_factory=list)
    fail: dict[str, BaseException] = field(default_factory=dict)
    # name -> a function run when that call is made (before it records), e.g. a send
    # racing a commit from another thread.
    during: dict[str, Callable[[], None]] = field(default_factory=dict)

    def call(self, name: str, *args: Any) -> None:
        hook = self.during.pop(name, None)
        if hook is not None:
            hook()
        exc = self.fail.get(name)
        if exc is not None:
            raise exc
        self.events.append((name, *args))

    def names(self) -> list[str]:
        return [e[0] for e in self.events]


class FakeConsumer:
    def __init__(self, calls: Calls, assignment: set[TopicPartition] | None = None) -> None:
        self.calls = calls
        self.meta = GroupMetadata()
        self._assignment = set(assignment or ())
        self.committed: dict[TopicPartition, OffsetAndMetadata] = {}  # the last commit, whole

    def commit(
        self, offsets: dict[TopicPartition, OffsetAndMetadata], timeout_ms: Any = None
    ) -> None:
        self.calls.call("commit", {tp: m.offset for tp, m in offsets.items()}, timeout_ms)
        self.committed = dict(offsets)

    def commit_async(self, offsets: dict[TopicPartition, OffsetAndMetadata]) -> None:
        self.calls.call("commit_async", {tp: m.offset for tp, m in offsets.items()})
        self.committed = dict(offsets)

    def group_metadata(self) -> GroupMetadata:
        return self.meta

    def assignment(self) -> set[TopicPartition]:
        return set(self._assignment)


class FakeFuture:
    """A send's outcome, as kafka-python's FutureRecordMetadata shows it."""

    def __init__(self, error: BaseException | None = None) -> None:
        self.is_done = True
        self.exception = error

    def failed(self) -> bool:
        return self.exception is not None


class _FakeTransactionManager:
    """The part of kafka-python's transaction manager the committer reaches into: offsets
    sent to the transaction and not yet accepted by the coordinator."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._pending_txn_offset_commits: dict[TopicPartition, OffsetAndMetadata] = {}


class FakeProducer:
    def __init__(self, calls: Calls, *, flushes_to_deliver: int = 0) -> None:
        self.calls = calls
        self._transaction_manager = _FakeTransactionManager()
        self.sent: list[tuple[str, bytes, bytes | None, Any]] = []  # every send, whole
        self.offsets: dict[TopicPartition, OffsetAndMetadata] = {}  # the last offsets sent
        # Sends stay undelivered until this many flushes (a batch the broker split).
        self._flushes_left = flushes_to_deliver
        self._futures: list[FakeFuture] = []

    def init_transactions(self) -> None:
        self.calls.call("init_transactions")

    def begin_transaction(self) -> None:
        self.calls.call("begin_transaction")

    def send(self, topic: str, value: bytes, key: bytes | None, headers: Any) -> Any:
        self.calls.call("send", topic, key)
        self.sent.append((topic, value, key, headers))
        future = FakeFuture(self.calls.fail.get("delivery"))
        future.is_done = self._flushes_left == 0
        self._futures.append(future)
        return future

    def send_offsets_to_transaction(
        self, offsets: dict[TopicPartition, OffsetAndMetadata], meta: GroupMetadata
    ) -> None:
        # As kafka-python does: the offsets join those still pending, all are sent, and
        # only offsets the coordinator accepts leave the pending set.
        pending = self._transaction_manager._pending_txn_offset_commits
        pending.update(offsets)
        self.calls.call(
            "send_offsets_to_transaction",
            {tp: m.offset for tp, m in pending.items()},
            (meta.generation_id, meta.member_id),
        )
        self.offsets = dict(pending)
        pending.clear()

    def commit_transaction(self) -> None:
        self.calls.call("commit_transaction")

    def abort_transaction(self) -> None:
        self.calls.call("abort_transaction")

    def flush(self, timeout: float | None = None) -> None:
        self.calls.call("flush", timeout)
        if self._flushes_left:
            self._flushes_left -= 1
        if not self._flushes_left:
            for f in self._futures:
                f.is_done = True

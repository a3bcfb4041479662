"""Stand-ins for what the stream roles are handed, for broker-free tests of a role: a
recording logger, a delivery (`DeliveryPort`) and a consumer that poll, seek and commit
nothing real. Each records what it is asked, in order."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from kafka import TopicPartition
from kafka.consumer.subscription_state import SubscriptionState
from kafka.structs import OffsetAndMetadata

from dgstream.workers.commit import Marks, Ready
from dgstream.workers.hosting.metrics import WorkerMetrics
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.kafka.settings import KafkaConnection
from dgstream.workers.steps.batches import Batch, Entry, Output
from dgstream.workers.stream.shared import Completions, Shared

T0, T1 = TopicPartition("in", 0), TopicPartition("in", 1)


def settings(**overrides: Any) -> WorkerSettings:
    base: dict[str, Any] = {
        "pipeline": "p",
        "input_topics": ["in"],
        "output_topic": "out",
        "dead_letter_topic": "dead",
        "group_id": "g",
        "kafka": KafkaConnection(bootstrap_servers="127.0.0.1:9"),
    }
    base.update(overrides)
    return WorkerSettings.model_validate(base)


class RecordingLog:
    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def _add(self, level: str, event: str, kw: dict[str, Any]) -> None:
        self.events.append((level, event, kw))

    def debug(self, event: str, **kw: Any) -> None:
        self._add("debug", event, kw)

    def info(self, event: str, **kw: Any) -> None:
        self._add("info", event, kw)

    def warning(self, event: str, **kw: Any) -> None:
        self._add("warning", event, kw)

    def error(self, event: str, **kw: Any) -> None:
        self._add("error", event, kw)

    def named(self, event: str) -> list[tuple[str, dict[str, Any]]]:
        """(level, fields) of each event of that name."""
        return [(level, kw) for level, e, kw in self.events if e == event]


def shared(**overrides: Any) -> Shared:
    s = settings(**overrides)
    return Shared(s, RecordingLog(), WorkerMetrics(s.pipeline, s.name, use_ray=False))


def batch(seq: int, *records: tuple[TopicPartition, int]) -> Batch:
    b = Batch(seq)
    for tp, off in records:
        b.add(Entry(tp, off, None, b"{}", 0))
    return b


@dataclass
class FakeDelivery:
    """A `DeliveryPort` whose commits commit what is ready, or raise `commit_error`."""

    must_abandon_unfinished: bool = False
    broken: bool = False
    calls: list[tuple[Any, ...]] = field(default_factory=list)
    commit_error: BaseException | None = None
    abort_error: BaseException | None = None
    in_txn: set[int] = field(default_factory=set)

    def send(self, batch: Batch, outputs: list[Output]) -> None:
        self.calls.append(("send", batch.seq, len(outputs)))

    def delivered(self, batch: Batch) -> None:
        self.calls.append(("delivered", batch.seq))
        batch.done = True

    def in_transaction(self) -> set[int]:
        return set(self.in_txn)

    def abort(self, cancel: Callable[[], None]) -> None:
        self.calls.append(("abort",))
        cancel()
        if self.abort_error is not None:
            raise self.abort_error

    def after_failed_send(self) -> None:
        self.calls.append(("after_failed_send",))

    def commit(
        self, ready: Callable[[], Ready], *, sync: bool, marks: Marks | None = None
    ) -> Ready:
        if self.commit_error is not None:
            error, self.commit_error = self.commit_error, None
            raise error
        done = ready()
        self.calls.append(("commit", dict(done), sync, dict(marks or {})))
        return done

    def renew(self) -> None:
        self.calls.append(("renew",))

    def names(self) -> list[str]:
        return [c[0] for c in self.calls]


@dataclass
class Meta:
    member_id: str = "m-1"
    generation_id: int = 1


@dataclass
class Rec:
    """A polled record, as kafka-python's ConsumerRecord shows it to the worker."""

    offset: int
    value: bytes | None = b"{}"
    key: bytes | None = None
    timestamp: int = 1_700_000_000_000
    headers: list[tuple[str, bytes | None]] = field(default_factory=list)


class FakeConsumer:
    """Polls what `feed` queued; records polls and seeks; knows committed offsets."""

    def __init__(self, assignment: set[TopicPartition] | None = None) -> None:
        self.meta: Meta | BaseException = Meta()
        self.assigned = set(assignment or {T0, T1})
        self.queued: list[dict[TopicPartition, list[Rec]]] = []
        self.polls: list[tuple[int, int]] = []  # (timeout_ms, max_records)
        self.seeks: list[tuple[TopicPartition, int]] = []
        self.paused: set[TopicPartition] = set()
        self.pauses: list[tuple[str, set[TopicPartition]]] = []  # ("pause"|"resume", tps)
        self.offsets: dict[TopicPartition, OffsetAndMetadata | BaseException] = {}
        self.lookups: list[tuple[TopicPartition, dict[str, Any]]] = []
        self.rejoin = False
        self.high: dict[TopicPartition, int | BaseException | None] = {}
        # kafka-python's own subscription state, where the fetcher keeps its positions
        # (`workers.kafka.quirks.read_position`): none known until `stand_at`.
        self._subscription = SubscriptionState()

        consumer = self

        class _Coordinator:
            def need_rejoin(self) -> bool:
                return consumer.rejoin

        self._coordinator = _Coordinator()

    def stand_at(self, positions: dict[TopicPartition, int]) -> None:
        """The fetcher's positions, as kafka-python's poll leaves them."""
        self._subscription.assign_from_user(sorted(self.assigned | set(positions)))
        for tp, offset in positions.items():
            self._subscription.seek(tp, offset)

    def feed(self, records: dict[TopicPartition, list[Rec]]) -> None:
        self.queued.append(records)

    def poll(self, timeout_ms: int, max_records: int) -> dict[TopicPartition, list[Rec]]:
        self.polls.append((timeout_ms, max_records))
        return self.queued.pop(0) if self.queued else {}

    def seek(self, tp: TopicPartition, offset: int) -> None:
        self.seeks.append((tp, offset))

    def pause(self, *tps: TopicPartition) -> None:
        self._assigned_only(tps)
        self.pauses.append(("pause", set(tps)))
        self.paused |= set(tps)

    def resume(self, *tps: TopicPartition) -> None:
        self._assigned_only(tps)
        self.pauses.append(("resume", set(tps)))
        self.paused -= set(tps)

    def _assigned_only(self, tps: tuple[TopicPartition, ...]) -> None:
        """kafka-python's pause() and resume() raise KeyError for a partition it does not
        hold (its subscription state has no entry for it)."""
        for tp in tps:
            if tp not in self.assigned:
                raise KeyError(tp)

    def assignment(self) -> set[TopicPartition]:
        return set(self.assigned)

    def group_metadata(self) -> Meta:
        if isinstance(self.meta, BaseException):
            raise self.meta
        return self.meta

    def committed(self, tp: TopicPartition, **kw: Any) -> Any:
        self.lookups.append((tp, kw))
        found = self.offsets.get(tp)
        if isinstance(found, BaseException):
            raise found
        if found is None:
            return None
        return found if kw.get("metadata") else found.offset

    def highwater(self, tp: TopicPartition) -> int | None:
        high = self.high.get(tp)
        if isinstance(high, BaseException):
            raise high
        return high


def roles(**overrides: Any) -> tuple[Shared, Completions, FakeDelivery, FakeConsumer]:
    return shared(**overrides), Completions(), FakeDelivery(), FakeConsumer()


class SendFuture:
    """A send's future as kafka-python's FutureRecordMetadata works for the worker: its
    callbacks run when it is resolved (at once when added after)."""

    def __init__(self) -> None:
        self._callbacks: list[Callable[[Any], None]] = []
        self._errbacks: list[Callable[[BaseException], None]] = []
        self.is_done = False
        self.exception: BaseException | None = None

    def add_callback(self, fn: Callable[[Any], None]) -> None:
        if self.is_done and self.exception is None:
            fn("metadata")
        else:
            self._callbacks.append(fn)

    def add_errback(self, fn: Callable[[BaseException], None]) -> None:
        if self.is_done and self.exception is not None:
            fn(self.exception)
        else:
            self._errbacks.append(fn)

    def failed(self) -> bool:
        return self.exception is not None

    def ack(self) -> None:
        self.is_done = True
        for fn in self._callbacks:
            fn("metadata")

    def fail(self, exc: BaseException) -> None:
        self.is_done, self.exception = True, exc
        for fn in self._errbacks:
            fn(exc)


class SendingProducer:
    """A producer whose sends stay pending until the test acks or fails them; the
    transactional calls are recorded (and fail on demand, `fail[name]`)."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes | None, SendFuture]] = []
        self.calls: list[str] = []
        self.fail: dict[str, BaseException] = {}
        self._transaction_manager = type("Manager", (), {"last_error": None})()

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    def send(self, topic: str, value: bytes, key: bytes | None, headers: Any) -> SendFuture:
        self._call("send")
        future = SendFuture()
        self.sent.append((topic, key, future))
        return future

    def init_transactions(self) -> None:
        self._call("init_transactions")

    def begin_transaction(self) -> None:
        self._call("begin_transaction")

    def abort_transaction(self) -> None:
        self._call("abort_transaction")

    def flush(self, timeout: float | None = None) -> None:
        self._call("flush")

    def close(self, timeout: float | None = None) -> None:
        self._call("close")


class ForgettingTopics:
    """What delivery asks of the topic guard: to forget a topic a send failed on."""

    def __init__(self) -> None:
        self.forgotten: list[str] = []

    def forget(self, topic: str) -> None:
        self.forgotten.append(topic)


def output(b: Batch, topic: str = "out", dead: str | None = None, i: int = 0) -> Output:
    entry = b.entries[i]
    return Output(topic, b"k%d" % entry.offset, b"v", [], entry, dead, None)

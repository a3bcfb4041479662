"""The two ways a worker commits: offsets after acknowledged outputs (at-least-once), or
outputs and offsets in one transaction (exactly-once).

Each commit is a short sequence of numbered steps. The committers make the Kafka calls;
deciding *what* may be committed is `workers.commit.offsets.OffsetTracker`'s job.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, TypeVar

from kafka import OffsetAndMetadata, TopicPartition
from kafka.errors import (
    CommitFailedError,
    FencedInstanceIdError,
    KafkaError,
    KafkaTimeoutError,
    ProducerFencedError,
)

from dgstream.workers.commit.offsets import Ready, commit_offsets
from dgstream.workers.faults.errors import CommitRefused, OutputFailed, WorkerFailed
from dgstream.workers.kafka.quirks import drop_refused_offsets
from dgstream.workers.steps.batches import Batch, Output

__all__ = ["AtLeastOnceCommitter", "Committer", "ExactlyOnceCommitter", "bounded"]

_T = TypeVar("_T")


# tp -> (offset, metadata): a commit that records something beside the offset (the
# poison guard's attempt counts, `workers.faults.poison`).
Marks = Mapping[TopicPartition, tuple[int, str]]


class Committer(Protocol):
    def commit(
        self, ready: Callable[[], Ready], *, sync: bool, marks: Marks | None = None
    ) -> Ready:
        """Commit what `ready()` (the tracker's contiguous done prefixes) allows, and
        `marks` for partitions with nothing ready; returns what was committed, {} for
        nothing now (the batches stay tracked and are tried again on the next pass).
        Raises `WorkerFailed` when this member must stop."""
        ...


# tp, offset -> the metadata of an ordinary commit of that offset (the poison guard's
# count, `workers.faults.poison.PoisonGuard.progress`); none by default.
Progress = Callable[[TopicPartition, int], str]


def _no_metadata(tp: TopicPartition, offset: int) -> str:
    return ""


def _metadata(
    offsets: Mapping[TopicPartition, int],
    marks: Marks | None = None,
    progress: Progress = _no_metadata,
) -> dict[TopicPartition, OffsetAndMetadata]:
    """Offsets to commit: `progress`'s metadata where work is done, the marks elsewhere."""
    out = {tp: OffsetAndMetadata(off, meta, -1) for tp, (off, meta) in (marks or {}).items()}
    out.update({tp: OffsetAndMetadata(off, progress(tp, off), -1) for tp, off in offsets.items()})
    return out


class CallTimedOut(KafkaTimeoutError):
    """A call `bounded` gave up on (its outcome is unknown)."""


def bounded(call: Callable[[], _T], timeout_s: float, what: str) -> _T:
    """`call()` on a helper thread, waited for at most `timeout_s`; raises
    KafkaTimeoutError after that. kafka-python's transactional calls (commit, abort,
    send_offsets_to_transaction) wait on their result without a bound; Java's bound them
    by max.block.ms. A call that timed out keeps its thread until it returns (the worker
    fails and closes the producer, which ends it). Raises CallTimedOut."""
    box: list[Any] = []

    def run() -> None:
        try:
            box.append((True, call()))
        except BaseException as exc:
            box.append((False, exc))

    t = threading.Thread(target=run, name=f"dgstream-{what}", daemon=True)
    t.start()
    t.join(timeout_s)
    if not box:
        raise CallTimedOut(f"{what} did not complete in {timeout_s:g} s")
    ok, value = box[0]
    if not ok:
        raise value
    out: _T = value
    return out


class AtLeastOnceCommitter:
    """Offsets through the consumer, after the broker acknowledged every output."""

    def __init__(
        self, consumer: Any, log: Any, timeout_s: float, progress: Progress = _no_metadata
    ) -> None:
        self._consumer = consumer
        self._log = log
        self._timeout_ms = int(timeout_s * 1000)
        self._progress = progress

    def commit(
        self, ready: Callable[[], Ready], *, sync: bool, marks: Marks | None = None
    ) -> Ready:
        done = ready()
        if not done and not marks:
            return {}
        offsets = _metadata(commit_offsets(done), marks, self._progress)
        # 1. The outputs: nothing to flush. A batch is done only once the broker has
        #    acknowledged every one of its outputs (acks=all).
        # 2. The offsets: wait for them on the consumer thread; from the rebalance
        #    listener (kafka-python's I/O thread) send them without waiting.
        try:
            if sync:
                self._consumer.commit(offsets, timeout_ms=self._timeout_ms)
            else:
                self._consumer.commit_async(offsets)
        except FencedInstanceIdError as exc:
            # Another live member has this replica's static id: this one is a zombie.
            raise WorkerFailed(f"fenced: {exc}") from exc
        except (CommitFailedError, KafkaError) as exc:
            # Usually a rebalance under way: the batches stay tracked and are committed on
            # the next pass (or forgotten when their partitions are revoked or lost).
            self._log.warning("commit_failed", error=f"{type(exc).__name__}: {exc}")
            return {}
        return done


class ExactlyOnceCommitter:
    """Outputs and offsets in one transaction of the replica's transactional producer.

    The engine loop `send`s a batch's outputs into the open transaction; `commit` (the
    consumer thread, or the listener) takes the batches sent so far and commits them with
    their partitions' offsets; `abort` drops the open transaction and cancels the batches
    still in flight, so that none of them sends into the next one."""

    def __init__(
        self, producer: Any, consumer: Any, timeout_s: float, progress: Progress = _no_metadata
    ) -> None:
        self._producer = producer
        self._consumer = consumer
        self._timeout_s = timeout_s
        self._progress = progress
        self._lock = threading.Lock()
        self._sent: list[Batch] = []  # batches whose outputs are in the open transaction
        self._futures: list[Any] = []  # their send futures
        # A send into the open transaction raised: it holds part of a batch's outputs and
        # must not be committed.
        self._broken: BaseException | None = None

    def start(self) -> None:
        """Fence an earlier incarnation of this replica (its open transaction is aborted),
        then open the first transaction."""
        self._producer.init_transactions()
        self._producer.begin_transaction()

    def send(self, batch: Batch, outputs: Sequence[Output]) -> list[Any] | None:
        """A batch's outputs into the open transaction (engine loop): their send futures;
        None, sending nothing, for a cancelled batch."""
        with self._lock:
            if batch.cancelled:
                return None
            futures = []
            try:
                for o in outputs:
                    futures.append(
                        self._producer.send(o.topic, value=o.value, key=o.key, headers=o.headers)
                    )
            except BaseException as exc:
                self._broken = self._broken or exc
                raise
            self._sent.append(batch)
            self._futures.extend(futures)
        return futures

    def in_transaction(self) -> set[int]:
        """ids of the batches whose outputs are in the open transaction."""
        with self._lock:
            return {id(b) for b in self._sent}

    def commit(
        self, ready: Callable[[], Ready], *, sync: bool = True, marks: Marks | None = None
    ) -> Ready:
        # One lock from taking the sent batches to the next transaction: a batch the
        # engine loop sends meanwhile must not be committed without its offsets.
        with self._lock:
            if self._broken is not None:
                raise OutputFailed(self._broken)
            if not self._sent and not marks and not ready():
                return {}  # (ready() without sent batches: idle partitions' positions)
            # 1. The outputs: delivered, every one (kafka-python would wait forever to add
            #    offsets to a transaction an output failed in). Their batches are done:
            #    their offsets go into this transaction.
            self._flush()
            for b in self._sent:
                b.done = True
            done = ready()
            offsets = _metadata(commit_offsets(done), marks, self._progress)
            # 2. Only a current member commits offsets: the coordinator accepts a
            #    transactional commit that names no member and no generation from anyone.
            meta = self._check_membership(offsets)
            try:
                # 3. The offsets into the same transaction, with the member id and
                #    generation, so the coordinator refuses them from a zombie.
                if offsets:
                    drop_refused_offsets(self._producer)
                    self._call(
                        lambda: self._producer.send_offsets_to_transaction(offsets, meta),
                        "send_offsets_to_transaction",
                    )
                # 4. Commit: outputs and offsets become visible together.
                self._call(self._producer.commit_transaction, "commit_transaction")
                # 5. Open the next transaction.
                self._producer.begin_transaction()
            except CommitFailedError as exc:
                # The coordinator refused the generation (a rebalance moved on without
                # this member): abortable, like a generation reset.
                raise CommitRefused(f"the group coordinator refused the commit: {exc}") from exc
            except (CallTimedOut, ProducerFencedError) as exc:
                # Timed out (the outcome is unknown) or fenced: the transaction is aborted
                # by this replica's next incarnation (same transactional id); its records
                # stay invisible to read_committed readers meanwhile.
                raise WorkerFailed(
                    f"transaction commit failed: {type(exc).__name__}: {exc}"
                ) from exc
            except KafkaError as exc:
                # An output failed (kafka-python fails the commit with it): abortable; if
                # the abort fails too, the producer is unusable and the worker fails.
                raise OutputFailed(exc) from exc
            except Exception as exc:
                raise WorkerFailed(
                    f"transaction commit failed: {type(exc).__name__}: {exc}"
                ) from exc
            self._sent, self._futures = [], []
        return done

    def _flush(self) -> None:
        """Wait for the open transaction's outputs; OutputFailed with the first error.

        kafka-python's flush() can return before outputs of a batch it split (one the
        broker found too large) are done, or raise UnknownError("Future not done") for
        them: flush again until every output is done, within the commit timeout."""
        deadline = time.monotonic() + self._timeout_s
        while True:
            left = deadline - time.monotonic()
            try:
                self._producer.flush(timeout=max(left, 0.001))
            except KafkaTimeoutError as exc:
                raise OutputFailed(exc) from exc
            except KafkaError:
                pass  # the split batches are on their way: look again
            pending = [f for f in self._futures if not f.is_done]
            if not pending:
                break
            if time.monotonic() >= deadline:
                raise OutputFailed(KafkaTimeoutError(f"{len(pending)} outputs not delivered"))
        for f in self._futures:
            if f.failed():
                raise OutputFailed(f.exception)

    def _check_membership(self, offsets: Mapping[TopicPartition, Any]) -> Any:
        """The consumer's group metadata, when it may commit `offsets`; else CommitRefused.

        After UNKNOWN_MEMBER_ID (the session expired) kafka-python resets the generation
        to -1 and the member id to "" until the next rejoin; a transactional offset commit
        carrying those is not checked against the group at all."""
        meta = self._consumer.group_metadata()
        if meta.generation_id < 0 or not meta.member_id:
            raise CommitRefused(
                f"not a member of the group now (generation {meta.generation_id}, "
                f"member id {meta.member_id!r})"
            )
        owned = self._consumer.assignment()
        foreign = sorted(f"{tp.topic}-{tp.partition}" for tp in offsets if tp not in owned)
        if foreign:
            raise CommitRefused(f"partitions no longer assigned: {', '.join(foreign)}")
        return meta

    def abort(self, cancel: Callable[[], None] | None = None) -> None:
        """Cancel (`cancel()`: mark the batches in flight cancelled), abort the open
        transaction, open the next. One lock: a batch in flight either sent before the
        abort (and is aborted with it) or sees itself cancelled."""
        with self._lock:
            if cancel is not None:
                cancel()
            self._sent, self._futures, self._broken = [], [], None
            self._call(self._producer.abort_transaction, "abort_transaction")
            self._producer.begin_transaction()

    def _call(self, call: Callable[[], Any], what: str) -> Any:
        return bounded(call, self._timeout_s, what)

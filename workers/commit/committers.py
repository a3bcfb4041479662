"""The two ways a worker commits: offsets after acknowledged outputs (at-least-once), or
outputs and offsets in one transaction (exactly-once).

Each commit is a short sequence of numbered steps. The committers make the Kafka calls;
deciding *what* may be committed is `workers.commit.offsets.OffsetTracker`'s job.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

from kafka import OffsetAndMetadata, TopicPartition
from kafka.errors import CommitFailedError, FencedInstanceIdError, KafkaError

from workers.batches import Batch, Output
from workers.commit.offsets import Ready, commit_offsets
from workers.errors import WorkerFailed

__all__ = ["AtLeastOnceCommitter", "Committer", "ExactlyOnceCommitter"]


class Committer(Protocol):
    def commit(self, ready: Callable[[], Ready], *, sync: bool) -> Ready:
        """Commit what `ready()` (the tracker's contiguous done prefixes) allows; returns
        what was committed, {} for nothing now (the batches stay tracked and are tried
        again on the next pass). Raises `WorkerFailed` when this member must stop."""
        ...


def _metadata(offsets: Mapping[TopicPartition, int]) -> dict[TopicPartition, OffsetAndMetadata]:
    return {tp: OffsetAndMetadata(off, "", -1) for tp, off in offsets.items()}


class AtLeastOnceCommitter:
    """Offsets through the consumer, after the broker acknowledged every output."""

    def __init__(self, consumer: Any, log: Any) -> None:
        self._consumer = consumer
        self._log = log

    def commit(self, ready: Callable[[], Ready], *, sync: bool) -> Ready:
        done = ready()
        if not done:
            return {}
        offsets = commit_offsets(done)
        # 1. The outputs: nothing to flush. A batch is done only once the broker has
        #    acknowledged every one of its outputs (acks=all).
        # 2. The offsets: wait for them on the consumer thread; from the rebalance
        #    listener (kafka-python's I/O thread) send them without waiting.
        try:
            if sync:
                self._consumer.commit(_metadata(offsets))
            else:
                self._consumer.commit_async(_metadata(offsets))
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
    their partitions' offsets."""

    def __init__(self, producer: Any, consumer: Any) -> None:
        self._producer = producer
        self._consumer = consumer
        self._lock = threading.Lock()
        self._sent: list[Batch] = []  # batches whose outputs are in the open transaction

    def start(self) -> None:
        """Fence an earlier incarnation of this replica (its open transaction is aborted),
        then open the first transaction."""
        self._producer.init_transactions()
        self._producer.begin_transaction()

    def send(self, batch: Batch, outputs: Sequence[Output]) -> None:
        """A batch's outputs into the open transaction (engine loop)."""
        with self._lock:
            for o in outputs:
                self._producer.send(o.topic, value=o.value, key=o.key, headers=o.headers)
            self._sent.append(batch)

    def in_transaction(self) -> set[int]:
        """ids of the batches whose outputs are in the open transaction."""
        with self._lock:
            return {id(b) for b in self._sent}

    def commit(self, ready: Callable[[], Ready], *, sync: bool = True) -> Ready:
        # One lock from taking the sent batches to the next transaction: a batch the
        # engine loop sends meanwhile must not be committed without its offsets.
        with self._lock:
            sent, self._sent = self._sent, []
            if not sent:
                return {}
            # 1. The outputs: already in the transaction (commit_transaction flushes them).
            #    Their batches are done: their offsets go into this transaction.
            for b in sent:
                b.done = True
            done = ready()
            producer = self._producer
            try:
                # 2. The offsets into the same transaction, with the consumer's group
                #    metadata, so the group coordinator fences a zombie of this member.
                if done:
                    producer.send_offsets_to_transaction(
                        _metadata(commit_offsets(done)), self._consumer.group_metadata()
                    )
                # 3. Commit: outputs and offsets become visible together.
                producer.commit_transaction()
                # 4. Open the next transaction.
                producer.begin_transaction()
            except Exception as exc:
                # The transaction is aborted by this replica's next incarnation (same
                # transactional id); its records stay invisible to read_committed readers.
                raise WorkerFailed(
                    f"transaction commit failed: {type(exc).__name__}: {exc}"
                ) from exc
        return done

    def abort(self) -> None:
        """Abort the open transaction (on the way out; errors are the caller's)."""
        with self._lock:
            self._sent = []
            self._producer.abort_transaction()

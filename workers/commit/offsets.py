"""Offset tracking: which batches hold each partition's records, and how far each
partition may be committed.

A partition may be committed up to `last offset + 1` of its *contiguous done prefix*: the
oldest batches holding its records, each done (outputs acknowledged, or in the open
transaction). A later batch that finished first waits for the earlier ones, so a crash
never skips a record. Plain data, no Kafka calls: the consumer thread (and the rebalance
listener, under the worker's state lock) drive it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping

from kafka import TopicPartition

from dgstream.workers.steps.batches import Batch

__all__ = ["OffsetTracker", "Ready"]

# tp -> (offset to commit, number of the partition's oldest batches it covers)
Ready = dict[TopicPartition, tuple[int, int]]


class OffsetTracker:
    """Batches between submit and commit, per partition, oldest first."""

    def __init__(self) -> None:
        self.pending: dict[int, Batch] = {}  # submitted, not yet retired (holds a slot)
        self.committed: dict[TopicPartition, int] = {}
        self._tracks: dict[TopicPartition, deque[Batch]] = {}
        self._base: dict[TopicPartition, int] = {}  # first offset seen, before any commit

    @property
    def in_flight(self) -> int:
        """Submitted batches that still hold a slot."""
        return len(self.pending)

    def saw(self, tp: TopicPartition, offset: int) -> None:
        """The first offset polled from `tp`: the lag's base until the first commit."""
        if tp not in self.committed and tp not in self._base:
            self._base[tp] = offset

    def lag_base(self, tp: TopicPartition) -> int | None:
        """Where the partition's unfinished work starts: its committed offset, else the
        first offset polled from it."""
        return self.committed.get(tp, self._base.get(tp))

    def track(self, batch: Batch) -> None:
        """A batch was submitted: it holds a slot until each of its partitions retires it."""
        batch.open = set(batch.last)
        for tp in batch.open:
            self._tracks.setdefault(tp, deque()).append(batch)
        self.pending[batch.seq] = batch

    def batches(self, tps: Iterable[TopicPartition]) -> list[Batch]:
        """The tracked batches holding records of `tps` (a batch once per partition)."""
        return [b for tp in tps for b in self._tracks.get(tp, ())]

    def ready(self, idle: Mapping[TopicPartition, int] | None = None) -> Ready:
        """Every partition whose oldest tracked batches are done: the offset to commit
        and how many batches it covers.

        `idle`: the consumer's position in partitions it holds nothing polled and unsent
        from. A partition without tracked batches whose position passed its committed
        offset may be committed up to that position (covering no batch): everything in
        between was committed work or what the consumer never returns (transaction markers,
        aborted records). Without it, a partition whose last records are a transaction's
        marker or an aborted transaction keeps a lag that never drains. A partition whose
        tracked batches are all done is committed up to its position at once, in the same
        commit as theirs: behind a transactional upstream each transaction's marker would
        otherwise cost a commit of its own once the partition goes idle."""
        idle = idle or {}
        out: Ready = {}
        for tp, dq in self._tracks.items():
            n = 0
            for b in dq:
                if not b.done:
                    break
                n += 1
            if n:
                offset = dq[n - 1].last[tp] + 1
                if n == len(dq):
                    offset = max(offset, idle.get(tp, offset))
                out[tp] = (offset, n)
        for tp, position in idle.items():
            committed = self.committed.get(tp)
            if tp not in self._tracks and committed is not None and position > committed:
                out[tp] = (position, 0)
        return out

    def retire(self, ready: Ready) -> None:
        """`ready` was committed: drop the batches it covers, remember the offsets."""
        for tp, (offset, n) in ready.items():
            dq = self._tracks.get(tp)
            if dq is not None:
                for _ in range(n):
                    self._release(dq.popleft(), tp)
                if not dq:
                    del self._tracks[tp]
            self.committed[tp] = offset

    def forget(self, tps: Iterable[TopicPartition], *, keep_committed: bool = False) -> int:
        """The partitions left this member: drop their batches (they are consumed again
        by the next owner); returns how many batches were abandoned."""
        abandoned = 0
        for tp in tps:
            for b in self._tracks.pop(tp, ()):
                abandoned += 1
                self._release(b, tp)
            if not keep_committed:
                self.committed.pop(tp, None)
            self._base.pop(tp, None)
        return abandoned

    def _release(self, batch: Batch, tp: TopicPartition) -> None:
        batch.open.discard(tp)
        if not batch.open:
            self.pending.pop(batch.seq, None)


def commit_offsets(ready: Ready) -> dict[TopicPartition, int]:
    """The offsets a `Ready` asks to commit."""
    return {tp: off for tp, (off, _) in ready.items()}

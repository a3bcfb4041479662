"""Poison records: one that keeps killing the worker (an engine crash on it, the process
killed while it runs) is isolated after a bounded number of restarts and dead-lettered
POISON, instead of a crash loop with unbounded duplicates.

The attempts are counted in the metadata of the partition's committed offset, so the count
is per partition and group, travels with the offset (under exactly-once, in the same
transaction) and every ordinary commit clears it. Why there, and the protocol step by step:
docs/worker.md, "Poison records".
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from kafka import TopicPartition

from dgstream.workers.hosting.settings import PoisonTuning

__all__ = ["PROGRESS", "Attempts", "Mark", "PoisonGuard", "parse_attempts"]

_PREFIX = "dgstream:v1"
_RE = re.compile(r"^dgstream:v1;started=(\d{1,6});alone=(\d{1,6})$")

# (offset, metadata) to commit for a partition
Mark = tuple[int, str]


@dataclass(frozen=True)
class Attempts:
    """How often the work at one committed offset was started by incarnations that died
    before committing past it, and how often its first record was running alone then."""

    started: int = 0
    alone: int = 0

    def text(self) -> str:
        if not self.started and not self.alone:
            return ""
        return f"{_PREFIX};started={self.started};alone={self.alone}"


# An ordinary commit's metadata when no count is carried (`PoisonGuard.progress`): the
# work from the new offset was started by the incarnation that committed it. Should it
# die before committing past it, the next owner counts that death too.
PROGRESS = Attempts(started=1).text()


def parse_attempts(text: str | None) -> Attempts:
    """The attempts a committed offset's metadata records; none for anything else
    (another tool's metadata, or none)."""
    m = _RE.match(text or "")
    return Attempts(int(m.group(1)), int(m.group(2))) if m else Attempts()


@dataclass
class _Partition:
    start: int  # the committed offset the count applies to
    read: Attempts  # the count there before this incarnation's start (read, or carried)
    careful_left: int  # records still to run one at a time
    origin: int  # where that count was read: the deaths it holds had records from here
    progressed: bool = False  # a commit went past the first `start`
    dirty: bool = True  # this incarnation's start is counted at `start` (not written back)


class PoisonGuard:
    """The per-partition state of the protocol above, for one incarnation (plain data;
    the worker makes the commits it asks for)."""

    def __init__(self, tuning: PoisonTuning, window: int) -> None:
        self._tuning = tuning
        self._window = window
        self._parts: dict[TopicPartition, _Partition] = {}
        # What this incarnation counted, kept when a partition leaves and comes back
        # (a rebalance is no second start): tp -> offset of `started`; (tp, offset) alone.
        self._started: dict[TopicPartition, int] = {}
        self._alone: set[tuple[TopicPartition, int]] = set()

    def known(self, tp: TopicPartition) -> bool:
        return tp in self._parts

    def first_seen(
        self, tp: TopicPartition, first: int, committed: int | None, metadata: str | None
    ) -> Mark:
        """The partition's first records this incarnation start at `first`; returns the
        mark to commit before they run (started + 1)."""
        read = parse_attempts(metadata) if committed == first else Attempts()
        again = self._started.get(tp) == first  # counted already, before it left
        if again:
            read = Attempts(max(read.started - 1, 0), read.alone)
        t = self._tuning
        suspect = read.started >= t.suspect_after or read.alone > 0
        self._parts[tp] = _Partition(first, read, self._window if suspect else 0, first)
        self._started[tp] = first
        return first, Attempts(read.started + 1, read.alone).text()

    def careful(self) -> bool:
        """Some partition is suspect: every record runs alone."""
        return any(p.careful_left > 0 for p in self._parts.values())

    def suspect(self, tp: TopicPartition) -> bool:
        p = self._parts.get(tp)
        return p is not None and p.careful_left > 0

    def poison(self, tp: TopicPartition, offset: int) -> Attempts | None:
        """The count when the record at `offset` is to be dead-lettered POISON."""
        p = self._parts.get(tp)
        if p is None or offset != p.start:
            return None
        return p.read if p.read.alone >= self._tuning.poison_after else None

    def before_alone(self, tp: TopicPartition, offset: int) -> Mark | None:
        """A suspect partition's record is about to run alone: the mark that counts it
        (None when this incarnation counted it already, e.g. after an outage's retry)."""
        p = self._parts.get(tp)
        if p is None or p.careful_left <= 0 or (tp, offset) in self._alone:
            return None
        self._alone.add((tp, offset))
        base = p.read if offset == p.start else Attempts()
        p.dirty = p.dirty or offset == p.start
        return offset, Attempts(base.started + 1, base.alone + 1).text()

    def progress(self, tp: TopicPartition, offset: int) -> str:
        """The metadata of an ordinary commit of `offset`: the starts counted where this
        incarnation read its count, while `offset` is within the window of records the
        dead incarnations could have had in flight from there (those before `offset` were
        answered: the crash is further on), and this incarnation's own start. Past the
        window, its start alone (PROGRESS). A partition in the middle of its one-at-a-
        time run stays suspect (`suspect_after` starts at least)."""
        p = self._parts.get(tp)
        if p is None:
            return PROGRESS
        started = self._carried(p, offset).started + 1
        if p.careful_left - (offset - p.start) > 0:
            started = max(started, self._tuning.suspect_after)
        return Attempts(started, 0).text()

    def _carried(self, p: _Partition, offset: int) -> Attempts:
        if p.read.started and offset < p.origin + self._window:
            return Attempts(p.read.started, 0)
        return Attempts()

    def committed(self, tp: TopicPartition, offset: int) -> None:
        """A commit of `offset` went through, with the metadata `progress` gave it."""
        p = self._parts.get(tp)
        if p is None or offset <= p.start:
            return
        if p.careful_left > 0:
            p.careful_left = max(0, p.careful_left - (offset - p.start))
        carried = self._carried(p, offset)
        if not carried.started:
            p.origin = offset
        p.start, p.read, p.progressed, p.dirty = offset, carried, True, True
        self._started[tp] = offset  # this incarnation's start is counted here now

    def write_back(self, tps: set[TopicPartition]) -> dict[TopicPartition, Mark]:
        """Leaving cleanly (or on an outage): for each partition where this incarnation
        counted its start (first seen, or in its last commit's metadata), the mark that
        takes it out again, so that leaving is not counted as a crash."""
        out: dict[TopicPartition, Mark] = {}
        for tp in tps:
            p = self._parts.get(tp)
            if p is not None and p.dirty:
                out[tp] = (p.start, self._handed_over(p).text())
                p.dirty = False
                # Its counts are undone: should the partition come back (after another
                # owner's death, say), this incarnation counts its start there anew.
                self._started.pop(tp, None)
                self._alone = {a for a in self._alone if a[0] != tp}
        return out

    def _handed_over(self, p: _Partition) -> Attempts:
        """What a clean leave writes back: the count without this incarnation's start; a
        partition left in the middle of its one-at-a-time run stays suspect for the next
        owner (`suspect_after` starts), or the record that killed the last incarnations
        would run in a batch again, and the deaths to isolate it start over."""
        read, t = p.read, self._tuning
        if p.careful_left > 0 and read.started < t.suspect_after and not read.alone:
            return Attempts(t.suspect_after, read.alone)
        return read

    def forget(self, tps: set[TopicPartition]) -> None:
        for tp in tps:
            self._parts.pop(tp, None)

"""Recovery: what the worker does when a batch, a send or a commit ends badly, by the error
table (`workers.stream.actions`), and the commit step whose endings it handles.

Runs on the consumer thread, and in the rebalance listener while the consumer thread
waits inside poll() (kafka-python's I/O thread; always under the shared lock). It reaches
delivery only through `DeliveryPort` (the commit, the abort), and the rest through the
shared state; nothing calls back into it but the other roles' ports.

Abandoning (`abandon`): the work between poll and commit is given up and read again from
the committed offsets: the batches in flight are cancelled (they produce nothing more;
exactly-once: the open transaction is aborted with them), the batch being filled is
dropped, and each of their partitions still assigned is sought back (`Shared.rewind`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

from kafka import TopicPartition

from dgstream.workers.commit import Marks
from dgstream.workers.faults.errors import CommitRefused, OutputFailed, WorkerFailed
from dgstream.workers.faults.outage import Outage
from dgstream.workers.kafka.quirks import read_position
from dgstream.workers.steps.batches import Batch, tp_name
from dgstream.workers.stream.actions import TABLE, Action, counts_when_abandoned, kind_of, outage_of
from dgstream.workers.stream.shared import Completions, DeliveryPort, Shared

__all__ = ["REDO_LIMIT", "Recovery"]

# An output the broker refuses for good reads the open work again at once, this many times
# in a row at most (one suffices once the output check knows the topic's new limit or
# ACLs); past that, the refusals are handled as an outage: backoff, within the budget.
REDO_LIMIT = 3


class Recovery:
    """The error table's actions, and the commit step (`settle`)."""

    def __init__(
        self, shared: Shared, completions: Completions, delivery: DeliveryPort, consumer: Any
    ) -> None:
        self._s = shared
        self._completions = completions
        self._delivery = delivery
        self._consumer = consumer
        self._member = ""  # the member id the work in flight was fetched under
        self._redo_streak = 0  # reads again in a row without a commit in between
        self._actions: dict[Action, Callable[[BaseException], None]] = {
            Action.BACK_OFF: self._back_off,
            Action.REDO: self._redo,
            Action.ABANDON: lambda exc: self.abandon(str(exc)),
            Action.FAIL: self._s.fail,
        }

    # ------------------------------------------------------------------ the table

    def act(self, exc: BaseException) -> None:
        """Do what the error table says for `exc` (one that reached the consumer thread)."""
        self._actions[TABLE[kind_of(exc)].action](exc)

    def apply_completions(self) -> None:
        """Mark the batches that finished as delivered; act on the ones that failed."""
        for batch, exc in self._completions.take():
            if exc is None:
                self._delivered(batch)
            elif not batch.cancelled or counts_when_abandoned(exc):
                self.act(exc)  # an abandoned batch's other endings: it is read again

    def _delivered(self, batch: Batch) -> None:
        self._delivery.delivered(batch)
        if self._s.outage.active:
            self._end_outage()

    def _back_off(self, exc: BaseException) -> None:
        """An outage: abandon the open work (read again after the pause) or, past the
        budget, fail."""
        self._outage(outage_of(exc))

    def _outage(self, outage: Outage) -> None:
        s = self._s
        pause = s.outage.hit(outage)
        s.metrics.record_outage_try(outage.kind)
        if s.outage.exhausted():
            budget = s.settings.outage.budget_s
            # An outage is not the records' fault: this incarnation's attempts are not
            # counted (best effort: the commit may be out of reach too).
            self.abandon(str(outage))
            with contextlib.suppress(Exception):
                marks = s.poison.write_back(set(s.assignment))
                if marks:
                    self._delivery.commit(dict, sync=True, marks=marks)
            s.fail(WorkerFailed(f"{outage} for longer than the outage budget ({budget:g} s)"))
            return
        s.log.warning(
            "outage",
            kind=outage.kind,
            tries=s.outage.tries,
            pause_s=round(pause, 3),
            error=outage.message[:300],
        )
        self.abandon(str(outage))

    def _redo(self, exc: BaseException) -> None:
        """The broker refused an output for good: read the open work again at once (the
        output check now knows why and dead-letters that record); a refusal that keeps
        coming back is handled as an outage (backoff, budget)."""
        self._redo_streak += 1
        if self._redo_streak > REDO_LIMIT:
            self._outage(Outage("output", f"outputs keep failing: {exc}"[:500]))
            return
        self.abandon(str(exc))
        self._delivery.after_failed_send()

    def _end_outage(self) -> None:
        s = self._s
        kind, tries = s.outage.kind, s.outage.tries
        lasted = s.outage.clear()
        s.metrics.record_outage_over()
        s.log.info("outage_over", kind=kind, tries=tries, lasted_s=round(lasted, 3))

    # ------------------------------------------------------------------ the commit step

    def settle(self, *, sync: bool, marks: Marks | None = None) -> None:
        """Apply completions, commit the contiguous done prefix of each partition (and
        `marks`, the poison guard's attempt counts, for partitions with none).

        `sync`: commit and wait (consumer thread); otherwise commit_async (the listener,
        which runs on the I/O thread and must not block on it). A `WorkerFailed` of the
        commit is raised: the replica fails at once."""
        self.apply_completions()
        s = self._s
        if s.failure is not None:
            return
        self._note_membership()
        # Only the consumer thread reads positions: the listener runs inside its poll().
        idle = self._idle_positions() if sync else {}
        try:
            committed = self._delivery.commit(lambda: s.offsets.ready(idle), sync=sync, marks=marks)
        except (CommitRefused, OutputFailed) as exc:
            self.act(exc)
            return
        for tp, (offset, _) in committed.items():
            s.poison.committed(tp, offset)
        if committed:
            self._redo_streak = 0
            s.offsets.retire(committed)
            s.metrics.set_in_flight(s.offsets.in_flight)

    def _idle_positions(self) -> dict[TopicPartition, int]:
        """The consumer's position in each assigned partition that holds nothing polled
        and unsent (the batch being filled) and no pending rewind (whose dropped records
        the position has passed); the tracker takes those whose tracked batches are all
        done (or that have none)."""
        s = self._s
        held = set(s.acc.last) if s.acc is not None else set()
        out: dict[TopicPartition, int] = {}
        for tp in s.assignment:
            if tp in held or tp in s.rewind:
                continue
            position = read_position(self._consumer, tp)
            if position is not None:
                out[tp] = position
        return out

    def _note_membership(self) -> None:
        """Abandon the open work when the member id changed under it: the member was out of
        the group meanwhile, and another may have answered and committed those records.
        kafka-python does not always say so: a JoinGroup refused with UNKNOWN_MEMBER_ID
        rejoins under a new id with the partitions kept and no on_partitions_lost."""
        try:
            member = self._consumer.group_metadata().member_id
        except Exception:
            return
        if not member:
            return  # out of the group now: exactly-once refuses to commit meanwhile
        if self._member and member != self._member:
            self.act(CommitRefused(f"member id changed from {self._member} to {member}"))
        self._member = member

    # ------------------------------------------------------------------ abandoning

    def abandon(self, reason: str) -> None:
        """Give up everything between poll and commit (the module's docstring); under the
        shared lock."""
        s = self._s
        with s.lock:
            batches = list(s.offsets.pending.values())
            tps = {tp for b in batches for tp in b.last}
            if s.acc is not None:
                tps |= set(s.acc.last)
            if not tps:
                return  # nothing polled is unfinished (the transaction holds nothing)
            for tp in tps:
                start = s.offsets.lag_base(tp)
                if start is not None:
                    s.rewind[tp] = min(start, s.rewind.get(tp, start))
            s.acc = None

            def cancel() -> None:
                for b in batches:
                    b.cancelled = True

            try:
                self._delivery.abort(cancel)
            except WorkerFailed as exc:
                self.act(exc)  # fenced
            s.offsets.forget(tps, keep_committed=True)
            s.metrics.set_in_flight(s.offsets.in_flight)
        s.log.warning(
            "open_work_abandoned",
            reason=reason,
            batches=len(batches),
            partitions=sorted(tp_name(tp) for tp in tps),
        )

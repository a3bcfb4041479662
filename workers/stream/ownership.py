"""Partition ownership: the consumer's group membership, what a revocation or a loss does to
the work in flight, reading abandoned work again (the rewind), and the lag per partition.

Threads: the rebalance listener (`Listener`) runs on kafka-python's I/O thread while the
consumer thread waits inside poll(); `refresh` and `update_lag` run on the consumer thread
between polls. Never both at once; both hold the shared lock. Revocations finish and
commit through `RecoveryPort`, and ask delivery (`DeliveryPort`) whether unfinished work
may outlive the partitions.
"""

from __future__ import annotations

import time
from typing import Any

from kafka import ConsumerRebalanceListener, KafkaConsumer, TopicPartition
from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor
from kafka.errors import KafkaError

from dgstream.workers.faults.errors import WorkerFailed
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.kafka.admin import admin_client
from dgstream.workers.kafka.quirks import committed_offset
from dgstream.workers.steps.batches import tp_name
from dgstream.workers.steps.inputs import bound_consumer
from dgstream.workers.stream.shared import Completions, DeliveryPort, RecoveryPort, Shared

__all__ = ["LAG_EVERY_S", "Listener", "Ownership", "make_consumer", "membership"]

# Lag per partition is recomputed at most this often (local reads only; the autoscaler
# polls every 5 s by default).
LAG_EVERY_S = 0.5

Records = dict[TopicPartition, list[Any]]


def make_consumer(settings: WorkerSettings, client_id: str) -> Any:
    """The group member: cooperative-sticky, no auto-commit, static when asked, with its
    record batches bounded in memory (`bound_consumer`) before its first poll."""
    s = settings
    options: dict[str, Any] = {
        "group_id": s.group_id,
        "enable_auto_commit": False,
        "auto_offset_reset": s.consumer.auto_offset_reset,
        "isolation_level": s.consumer.isolation_level,
        "partition_assignment_strategy": [CooperativeStickyAssignor],
        "max_poll_records": s.batching.max_records,
        "session_timeout_ms": s.consumer.session_timeout_ms,
        "heartbeat_interval_ms": s.consumer.heartbeat_interval_ms,
        "max_poll_interval_ms": s.consumer.max_poll_interval_ms,
    }
    if s.static_membership:
        options["group_instance_id"] = s.group_instance_id
    consumer = KafkaConsumer(**s.kafka.client_kwargs(client_id=f"{client_id}-consumer"), **options)
    bound_consumer(consumer, settings)
    return consumer


def membership(consumer: Any) -> dict[str, Any]:
    """This member's generation and id as its consumer knows them (-1 and "" while it is
    out of the group)."""
    if consumer is None:
        return {"generation": -1, "member_id": ""}
    try:
        meta = consumer.group_metadata()
    except Exception:
        return {"generation": -1, "member_id": ""}
    return {"generation": meta.generation_id, "member_id": meta.member_id}


class Listener(ConsumerRebalanceListener):
    """Runs on kafka-python's I/O thread while the consumer thread is inside poll()."""

    def __init__(self, ownership: Ownership) -> None:
        self._ownership = ownership

    def on_partitions_revoked(self, revoked: Any) -> None:
        self._ownership.on_revoked(set(revoked), lost=False)

    def on_partitions_assigned(self, assigned: Any) -> None:
        self._ownership.on_assigned(set(assigned))

    def on_partitions_lost(self, lost: Any) -> None:
        self._ownership.on_revoked(set(lost), lost=True)


class Ownership:
    """Which partitions this member holds, and what changing them does to open work."""

    def __init__(
        self,
        shared: Shared,
        completions: Completions,
        recovery: RecoveryPort,
        delivery: DeliveryPort,
        consumer: Any,
    ) -> None:
        self._s = shared
        self._completions = completions
        self._recovery = recovery
        self._delivery = delivery
        self._consumer = consumer
        self._last_lag = 0.0

    # ------------------------------------------------------------------ the listener

    def on_assigned(self, assigned: set[TopicPartition]) -> None:
        self._s.log.info("partitions_assigned", partitions=sorted(tp_name(tp) for tp in assigned))

    def on_revoked(self, revoked: set[TopicPartition], *, lost: bool) -> None:
        """Finish (bounded) and commit the revoked partitions' work, then forget them.
        Lost partitions (this member was fenced) are forgotten without a commit."""
        if not revoked:
            return
        s, recovery = self._s, self._recovery
        names = sorted(tp_name(tp) for tp in revoked)
        with s.lock:
            if s.acc is not None:
                s.acc.drop(revoked)
            closing = s.closing or s.failure is not None
            if lost:
                s.metrics.record_lost(len(revoked))
            must_abandon = self._delivery.must_abandon_unfinished and not closing
            if lost and must_abandon:
                # The group gave these partitions to another: their outputs in the open
                # transaction (and those of batches still in flight) must not be committed
                # by this member's next commit.
                self._guard(lambda: recovery.abandon("partitions lost"))
            elif not lost and not closing:
                finished = self._await_batches(revoked)
                self._guard(lambda: recovery.settle(sync=False))
                if not finished and must_abandon:
                    # Their outputs would land in a later transaction without their
                    # offsets: abandon the open work (the kept partitions read it again).
                    self._guard(lambda: recovery.abandon("revoke timeout"))
            if not lost and not closing:
                marks = s.poison.write_back(revoked)
                if marks:
                    self._guard(lambda: recovery.settle(sync=False, marks=marks))
            s.poison.forget(revoked)
            # On the way out, status() keeps the last commits.
            abandoned = s.offsets.forget(revoked, keep_committed=s.closing)
            s.metrics.set_in_flight(s.offsets.in_flight)
        s.log.info(
            "partitions_lost" if lost else "partitions_revoked",
            partitions=names,
            abandoned_batches=abandoned,
        )

    def _guard(self, step: Any) -> None:
        """Run a commit step in the listener: a failure there fails the worker at its next
        loop (an exception would only reach kafka-python's poll())."""
        try:
            step()
        except Exception as exc:
            self._s.fail(WorkerFailed(f"{type(exc).__name__}: {exc}"))

    def _await_batches(self, tps: set[TopicPartition]) -> bool:
        """Wait until every batch holding records of `tps` is done (acknowledged, or in the
        open transaction), within the revoke timeout and half the session timeout (this
        runs on the consumer's I/O thread, which also sends the heartbeats). Returns whether
        they all finished."""
        s = self._s
        c = s.settings.consumer
        limit = min(c.revoke_timeout_s, c.session_timeout_ms / 2000)
        deadline = time.monotonic() + limit
        while True:
            self._recovery.apply_completions()
            if s.failure is not None:
                return False
            in_txn = self._delivery.in_transaction()
            waiting = [b for b in s.offsets.batches(tps) if not b.done and id(b) not in in_txn]
            if not waiting:
                return True
            if time.monotonic() >= deadline:
                s.log.warning("revoke_timeout", batches=len(waiting), seconds=limit)
                return False
            self._completions.wait(0.01)

    # ------------------------------------------------------------------ between polls

    def refresh(self, records: Records) -> Records:
        """Step 4's end (under the shared lock): the assignment as the consumer has it now,
        and the partitions whose work was abandoned sought back to the group's committed
        offset (another member may have moved it on), else to where the work started; what
        the last poll returned for them comes again."""
        s = self._s
        s.assignment = set(self._consumer.assignment())
        if not s.rewind:
            return records
        for tp, fallback in list(s.rewind.items()):
            records.pop(tp, None)
            if tp in s.assignment:
                try:
                    committed = committed_offset(self._consumer, tp)
                except KafkaError as exc:
                    # Unknown for now: the partition's records wait (dropped from this
                    # poll), and the next pass asks again; a guess could read past work
                    # that another member committed meanwhile.
                    s.log.warning("rewind_deferred", partition=tp_name(tp), error=str(exc))
                    continue
                self._consumer.seek(tp, fallback if committed is None else committed)
            del s.rewind[tp]
        return records

    def update_lag(self) -> None:
        """The lag per partition for status() and the metrics, at most every LAG_EVERY_S."""
        now = time.monotonic()
        if now - self._last_lag < LAG_EVERY_S:
            return
        self._last_lag = now
        s, lag = self._s, {}
        for tp in s.assignment:
            try:
                high = self._consumer.highwater(tp)
            except Exception:
                continue
            if high is None:
                continue
            base = s.offsets.lag_base(tp)
            if base is not None:
                lag[tp_name(tp)] = max(0, int(high) - int(base))
        s.metrics.set_lag(lag)

    def remove_static_member(self) -> None:
        """A static member never sends LeaveGroup: ask the coordinator to remove it, so its
        partitions move now rather than after session_timeout_ms."""
        from kafka.admin import MemberToRemove

        s = self._s.settings
        try:
            with admin_client(s.kafka) as admin:
                admin.remove_group_members(
                    s.group_id,
                    [
                        MemberToRemove(
                            group_instance_id=s.group_instance_id, reason="dgstream drain"
                        )
                    ],
                )
        except Exception as exc:
            self._s.log.warning("static_member_removal_failed", error=str(exc))

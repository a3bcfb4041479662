"""A rebalance while the worker's commits are slow (an exactly-once commit on a loaded
cluster takes hundreds of milliseconds) and another member rejoins late.

kafka-python 3.0 runs a member's JoinGroup and SyncGroup as a task of its I/O loop and
takes the result only while a `poll()` waits on it: a join that completes between two
polls is dropped and the next poll sends a new JoinGroup (from the group's leader, a new
rebalance). So while a rejoin is pending the worker stays in `poll()` and commits nothing:
a commit then is refused anyway (at-least-once: REBALANCE_IN_PROGRESS) or soon stale."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from bench.harness.faults import LogTap
from bench.harness.pipeline import INPUT_PARTITIONS, Pipeline, WorkerThread
from bench.harness.waiting import wait_for

pytestmark = pytest.mark.broker

# Each commit of the worker takes this long on top of its own round trips.
_SLOW_COMMIT_S = 1.0
# The second member rejoins this late (busy, or frozen until its session ends): meanwhile
# the worker's JoinGroup waits at the coordinator.
_LATE_REJOIN_S = 3.0


def test_a_worker_commits_nothing_while_its_rejoin_is_pending(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    from kafka import KafkaConsumer
    from kafka.coordinator.assignors.cooperative_sticky import CooperativeStickyAssignor

    from dgstream.workers.kafka.admin import subscribe_known
    from dgstream.workers.kafka.quirks import rejoin_pending

    wt = WorkerThread(pipeline.settings())
    in_a_rejoin = threading.Event()  # a commit started while the worker's join was pending

    def slow_commits() -> None:
        committer = wt.worker._delivery.committer
        inner = committer.commit

        def commit(*args: Any, **kwargs: Any) -> Any:
            if rejoin_pending(wt.worker._consumer):
                in_a_rejoin.set()
            time.sleep(_SLOW_COMMIT_S)  # a slow dependency, not a wait on a condition
            return inner(*args, **kwargs)

        committer.commit = commit

    LogTap(wt.worker).hooks["worker_started"] = slow_commits
    worker_threads.append(wt.start())
    wait_for(
        lambda: len(wt.worker.status()["assignment"]) == INPUT_PARTITIONS,
        60,
        "the worker to own every partition",
    )
    other = KafkaConsumer(
        **pipeline.conn.client_kwargs(client_id="late-member"),
        group_id=pipeline.group,
        enable_auto_commit=False,
        partition_assignment_strategy=[CooperativeStickyAssignor],
        session_timeout_ms=6000,
        heartbeat_interval_ms=1000,
    )
    try:
        subscribe_known(other, [pipeline.input])

        def split() -> bool:
            if other._coordinator.need_rejoin():
                time.sleep(_LATE_REJOIN_S)  # a slow member, not a wait on a condition
                other.poll(timeout_ms=10_000)  # then in poll() until its own join is done
            else:
                other.poll(timeout_ms=0)
            mine = set(wt.worker.status()["assignment"])
            theirs = {f"{tp.topic}-{tp.partition}" for tp in other.assignment()}
            return len(mine) == len(theirs) == INPUT_PARTITIONS // 2 and not mine & theirs

        wait_for(split, 90, "the two members to share the partitions", every_s=0.5)
        assert wt.error is None, wt.error
        assert not in_a_rejoin.is_set(), "the worker committed while its join was pending"
    finally:
        other.close(autocommit=False)

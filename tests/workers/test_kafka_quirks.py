"""The workarounds for kafka-python 3.0's private state (`workers.kafka.quirks`), without a
broker: each does what it says on the state it reaches into, and nothing (no
AttributeError) on a client without that state."""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import pytest
from kafka import TopicPartition
from kafka.errors import KafkaError, ProducerFencedError
from kafka.structs import MemberState, OffsetAndMetadata

from dgstream.workers.kafka.quirks import (
    OFFSET_FETCH_TIMEOUT_MS,
    committed_offset,
    drop_refused_offsets,
    fenced,
    fetching_partition,
    held_back,
    keep_finished_joins,
    no_auto_create,
    read_position,
    rejoin_pending,
    take_finished_join,
    unpark_resumed,
)

pytestmark = pytest.mark.unit

T0 = TopicPartition("in", 0)
T1 = TopicPartition("in", 1)


@pytest.mark.parametrize(
    ("last_error", "expected"),
    [
        (ProducerFencedError(), True),
        (ProducerFencedError, True),
        (KafkaError("an abortable error"), False),
        (None, False),
    ],
    ids=["fenced", "fenced-class", "abortable", "no-error"],
)
def test_a_fenced_producer_is_told_from_other_producer_errors(
    last_error: Any, expected: bool
) -> None:
    """Only a fenced producer must not be replaced (the new one would fence the newer
    incarnation); other fatal states are cured by a new producer."""
    producer = SimpleNamespace(_transaction_manager=SimpleNamespace(last_error=last_error))
    assert fenced(producer) is expected
    assert fenced(SimpleNamespace()) is False  # not transactional: never fenced


def test_a_producer_without_kafka_pythons_pending_offsets_has_none_to_drop() -> None:
    """Dropping refused offsets reads kafka-python's private state; a producer without it
    (another kafka-python, or none pending) is left alone instead of failing the commit."""
    for producer in (SimpleNamespace(), SimpleNamespace(_transaction_manager=SimpleNamespace())):
        drop_refused_offsets(producer)  # no AttributeError
    pending = {T0: OffsetAndMetadata(3, "", -1)}
    manager = SimpleNamespace(_pending_txn_offset_commits=pending, _lock=threading.Lock())
    drop_refused_offsets(SimpleNamespace(_transaction_manager=manager))
    assert pending == {} and not manager._lock.locked()


def test_the_producer_metadata_is_told_not_to_create_topics() -> None:
    config = {"allow_auto_create_topics": True, "retry_backoff_ms": 100}
    no_auto_create(SimpleNamespace(_metadata=SimpleNamespace(config=config)))
    assert config == {"allow_auto_create_topics": False, "retry_backoff_ms": 100}
    # A kafka-python whose metadata has no such key, or no config, or no metadata at all:
    # nothing is added, nothing fails.
    other: dict[str, Any] = {"retry_backoff_ms": 100}
    no_auto_create(SimpleNamespace(_metadata=SimpleNamespace(config=other)))
    assert other == {"retry_backoff_ms": 100}
    no_auto_create(SimpleNamespace(_metadata=SimpleNamespace(config=None)))
    no_auto_create(SimpleNamespace())


def _consumer(need_rejoin: Any) -> Any:
    return SimpleNamespace(_coordinator=SimpleNamespace(need_rejoin=need_rejoin))


def test_a_pending_rejoin_is_read_from_the_coordinator() -> None:
    assert rejoin_pending(_consumer(lambda: True)) is True
    assert rejoin_pending(_consumer(lambda: False)) is False
    assert rejoin_pending(_consumer(lambda: 1)) is True  # truthy, as kafka-python may say


def test_a_member_that_is_joining_or_unjoined_is_not_settled() -> None:
    """kafka-python refuses a commit on the client side while its member rebalances, even
    when no new rejoin is asked for (a join already under way): that is not settled."""
    for state, settled in [
        (MemberState.STABLE, True),
        (MemberState.REBALANCING, False),
        (MemberState.UNJOINED, False),
    ]:
        consumer = _consumer(lambda: False)
        consumer._coordinator.state = state
        assert rejoin_pending(consumer) is not settled, state


def test_no_coordinator_or_one_that_fails_means_no_rejoin_pending() -> None:
    def broken() -> bool:
        raise RuntimeError("the coordinator is closing")

    assert rejoin_pending(_consumer(broken)) is False
    assert rejoin_pending(SimpleNamespace(_coordinator=SimpleNamespace())) is False
    assert rejoin_pending(SimpleNamespace()) is False


class _Committed:
    def __init__(self) -> None:
        self.calls: list[tuple[TopicPartition, dict[str, Any]]] = []

    def committed(self, tp: TopicPartition, **kw: Any) -> Any:
        self.calls.append((tp, kw))
        return OffsetAndMetadata(7, "m", -1) if kw.get("metadata") else 7


def test_a_committed_offset_lookup_is_bounded() -> None:
    consumer = _Committed()
    assert committed_offset(consumer, T0) == 7
    assert committed_offset(consumer, T0, metadata=True) == OffsetAndMetadata(7, "m", -1)
    assert consumer.calls == [
        (T0, {"timeout_ms": OFFSET_FETCH_TIMEOUT_MS}),
        (T0, {"metadata": True, "timeout_ms": OFFSET_FETCH_TIMEOUT_MS}),
    ]


def test_the_partition_being_unpacked_is_read_from_the_fetcher() -> None:
    held = SimpleNamespace(topic_partition=T0)
    consumer = SimpleNamespace(_fetcher=SimpleNamespace(_next_partition_records=held))
    assert fetching_partition(consumer) == ("in", 0)
    # The exception kafka-python holds for the records in line names its partition too.
    meta = SimpleNamespace(partition=TopicPartition("other", 4))
    holder = SimpleNamespace(_next_partition_records=None, _next_in_line_exception_metadata=meta)
    assert fetching_partition(SimpleNamespace(_fetcher=holder)) == ("other", 4)


def test_no_fetcher_or_nothing_in_line_names_no_partition() -> None:
    assert fetching_partition(SimpleNamespace()) is None
    assert fetching_partition(None) is None
    empty = SimpleNamespace(_next_partition_records=SimpleNamespace(topic_partition=None))
    assert fetching_partition(SimpleNamespace(_fetcher=empty)) is None
    not_a_tp = SimpleNamespace(_next_partition_records=SimpleNamespace(partition=3))
    assert fetching_partition(SimpleNamespace(_fetcher=not_a_tp)) is None


def test_read_position_is_kafka_pythons_own_known_position_and_nothing_else() -> None:
    # kafka-python's real subscription state: an assigned partition with a position, one
    # assigned but awaiting its first position, and one not assigned.
    from kafka.consumer.subscription_state import SubscriptionState

    t1, t2 = TopicPartition("in", 1), TopicPartition("in", 2)
    sub = SubscriptionState()
    sub.assign_from_user([T0, t1])
    sub.seek(T0, 7)
    consumer = SimpleNamespace(_subscription=sub)
    assert read_position(consumer, T0) == 7
    assert read_position(consumer, t1) is None  # no position yet: nothing to commit
    assert read_position(consumer, t2) is None  # not assigned
    assert read_position(SimpleNamespace(), T0) is None  # a client without that state


def test_a_drained_in_line_record_set_is_cleared_so_parked_ones_come_back() -> None:
    """kafka-python restores a resumed partition's parked records only when nothing is in
    line (`is None`); a drained (falsy) records object in line must become None, and a
    live one (records still to hand out) must stay."""

    class InLine:
        def __init__(self, left: bool) -> None:
            self.left = left

        def __bool__(self) -> bool:
            return self.left

    drained = SimpleNamespace(_fetcher=SimpleNamespace(_next_partition_records=InLine(False)))
    unpark_resumed(drained)
    assert drained._fetcher._next_partition_records is None
    live_records = InLine(True)
    live = SimpleNamespace(_fetcher=SimpleNamespace(_next_partition_records=live_records))
    unpark_resumed(live)
    assert live._fetcher._next_partition_records is live_records
    unpark_resumed(SimpleNamespace())  # no fetcher: nothing to do, no AttributeError


def test_finished_joins_are_kept_once_and_only_while_rebalancing() -> None:
    """The wrapper is installed once (a second call changes nothing), and a finished join
    is taken only while the member still rebalances: a member whose generation was reset
    meanwhile (UNJOINED), or whose join is still running or failed, is left to
    kafka-python's own join as before."""
    import asyncio

    from kafka.coordinator.base import BaseCoordinator
    from kafka.future import Future

    keep_finished_joins()
    installed = BaseCoordinator.join_group_async
    keep_finished_joins()
    assert BaseCoordinator.join_group_async is installed

    class Member:
        def __init__(self, state: Any, task: Future | None) -> None:
            self.state = state
            self._lock = threading.Lock()
            self._generation = SimpleNamespace(generation_id=7, member_id="m", protocol="p")
            self.completed: list[tuple[Any, ...]] = []
            self.enabled = 0
            self._join_task = task
            self.rejoining = self.rejoin_needed = True

        def _enable_heartbeat(self) -> None:
            self.enabled += 1

        async def _on_join_complete_async(self, *args: Any) -> None:
            self.completed.append(args)

    def finished(value: Any = b"assignment", error: Exception | None = None) -> Future:
        task: Future = Future()
        if error is None:
            task.success(value)
        else:
            task.failure(error)
        return task

    member = Member(MemberState.REBALANCING, finished())
    assert asyncio.run(take_finished_join(member)) is True
    assert member.completed == [(7, "m", "p", b"assignment")]
    assert member.state is MemberState.STABLE and member.enabled == 1
    assert member._join_task is None and not member.rejoin_needed and not member.rejoining

    for left in (
        Member(MemberState.UNJOINED, finished()),  # the heartbeat reset the generation
        Member(MemberState.REBALANCING, Future()),  # still running
        Member(MemberState.REBALANCING, finished(error=KafkaError("refused"))),
        Member(MemberState.REBALANCING, None),  # no join at all
    ):
        state, task = left.state, left._join_task
        assert asyncio.run(take_finished_join(left)) is False
        assert left.completed == [] and left.enabled == 0
        assert left.state is state and left._join_task is task and left.rejoin_needed


def test_a_rebalancing_member_always_needs_its_join() -> None:
    """kafka-python joins only while need_rejoin() holds; a rejoin the metadata asked for
    stops being needed once the leader made the new assignment, before the member took
    it. While the member is REBALANCING, need_rejoin() must stay True (else it stays
    there, heartbeat off, for good); otherwise kafka-python's own answer stands."""
    from kafka.coordinator.consumer import ConsumerCoordinator

    keep_finished_joins()
    not_auto = SimpleNamespace(partitions_auto_assigned=lambda: False)
    for state, expected in ((MemberState.REBALANCING, True), (MemberState.STABLE, False)):
        member = SimpleNamespace(state=state, _subscription=not_auto)
        assert ConsumerCoordinator.need_rejoin(member) is expected, state


def _fetcher_with(**state: Any) -> SimpleNamespace:
    from kafka.consumer.subscription_state import SubscriptionState

    subscription = SubscriptionState()
    subscription.assign_from_user([T0, T1])
    for tp in (T0, T1):
        subscription.seek(tp, 0)
    fetcher = SimpleNamespace(
        _completed_fetches=[], _nodes_with_pending_fetch_requests=set(), **state
    )
    return SimpleNamespace(_fetcher=fetcher, _subscription=subscription)


def test_a_partition_waits_behind_a_flood_when_queued_or_parked_and_not_otherwise() -> None:
    """T0 hands out its records: T1 is held back when its fetch response is in line or
    its records were parked while it was paused (they come back only once nothing else is
    in line), and not when neither holds (its fetch is under way or answered)."""
    assert held_back(_fetcher_with(), T0) == set()
    queued = _fetcher_with()
    queued._fetcher._completed_fetches.append(SimpleNamespace(topic_partition=T1))
    assert held_back(queued, T0) == {T1}
    assert held_back(_fetcher_with(_paused_partition_records={T1: object()}), T0) == {T1}
    assert held_back(_fetcher_with(_paused_completed_fetches={T1: object()}), T0) == {T1}
    assert held_back(SimpleNamespace(), T0) == set()  # no such private state: nothing

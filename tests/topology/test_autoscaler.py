"""The autoscaling decision: KEDA-like sizing, activation, caps, stabilization windows,
and a failed lag query that never reads as zero."""

from __future__ import annotations

import pytest

from dgstream.topology.autoscaler import Autoscaler, Decision, Policy

pytestmark = pytest.mark.unit


def _auto(**kw: object) -> Autoscaler:
    base = {
        "min_replicas": 1,
        "max_replicas": 8,
        "target_lag_per_replica": 100,
        "activation_lag": 10,
        "scale_out_window_s": 0,
        "scale_in_window_s": 60,
    }
    base.update(kw)
    return Autoscaler(Policy(**base))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("lag", "partitions", "gpus", "want"),
    [
        (0, 8, 8, 1),  # the floor
        (99, 8, 8, 1),
        (101, 8, 8, 2),  # ceil
        (5000, 8, 8, 8),  # max_replicas
        (5000, 4, 8, 4),  # partitions
        (5000, 8, 3, 3),  # GPUs that can be had
    ],
)
def test_desired_size(lag: int, partitions: int, gpus: int, want: int) -> None:
    d = _auto().decide(0.0, 1, lag, partitions, gpus)
    assert d.desired == want


def test_activation_from_zero() -> None:
    a = _auto(min_replicas=0)
    assert a.decide(0, 0, 10, 8, 8).desired == 0  # at the threshold: stay inactive
    assert a.decide(1, 0, 11, 8, 8).desired == 1


def test_scale_out_is_immediate_and_scale_in_waits_for_the_window() -> None:
    a = _auto()
    assert a.decide(0, 1, 5000, 8, 8).desired == 8
    # The backlog drains: the recommendation falls, the pool holds for 60 s.
    for t in range(5, 60, 5):
        d = a.decide(t, 8, 0, 8, 8)
        assert d.desired == 8, d.reason
    assert a.decide(66, 8, 0, 8, 8).desired == 1


def test_scale_out_window_takes_the_lowest_recommendation() -> None:
    a = _auto(scale_out_window_s=10)
    a.decide(0, 1, 150, 8, 8)  # recommends 2
    d = a.decide(5, 1, 800, 8, 8)  # recommends 8, but 2 is in the window
    assert d.desired == 2


def test_failed_lag_query_keeps_the_size() -> None:
    a = _auto()
    d = a.decide(0, 5, None, 8, 8, error="NoBrokersAvailable")
    assert d.desired == 5 and not d.changes
    assert "lag unknown" in d.reason and "NoBrokersAvailable" in d.reason


def test_no_flapping_on_steady_noisy_load() -> None:
    a = _auto()
    current, changes = 4, 0
    # Lag wobbling around 4 replicas' worth for ten minutes at a 5 s poll.
    for i in range(120):
        lag = 350 + (60 if i % 2 else -60)
        d = a.decide(i * 5.0, current, lag, 8, 8)
        changes += d.changes
        current = d.desired
    assert changes <= 1


# ----------------------------------------------------------------------------- every path
# Each decision whole: the size, the recommendation, the lag, what the load needs, and the
# reason `dgstream status` shows for it.


def test_recommend_names_what_caps_it() -> None:
    a = _auto(max_replicas=8)
    assert a.recommend(0, 8, 8) == (1, "lag 0 / target 100 -> 0")
    assert a.recommend(100, 8, 8) == (1, "lag 100 / target 100 -> 1")
    assert a.recommend(101, 8, 8) == (2, "lag 101 / target 100 -> 2")
    assert a.recommend(5000, 8, 8) == (
        8,
        "lag 5000 / target 100 -> 50, capped at 8 by max_replicas",
    )
    assert a.recommend(5000, 4, 8) == (4, "lag 5000 / target 100 -> 50, capped at 4 by partitions")
    assert a.recommend(5000, 8, 3) == (3, "lag 5000 / target 100 -> 50, capped at 3 by gpus")
    assert a.recommend(5000, 0, 3) == (0, "lag 5000 / target 100 -> 50, capped at 0 by partitions")
    assert a.recommend(-5, 8, 8) == (1, "lag -5 / target 100 -> 0")  # never below zero


def test_a_decision_holds_the_measurements_it_was_made_from() -> None:
    d = _auto().decide(12.5, 1, 250, 8, 8)
    assert d == Decision(12.5, 1, 3, 250, 3, "scale out 1 -> 3: lag 250 / target 100 -> 3")
    assert d.changes
    keep = _auto().decide(3.0, 1, 0, 8, 8)
    assert keep == Decision(3.0, 1, 1, 0, 1, "keep 1: lag 0 / target 100 -> 0")
    assert not keep.changes


def test_scale_out_to_the_cap_is_a_scale_out() -> None:
    d = _auto().decide(0, 1, 5000, 8, 8)
    assert (d.desired, d.reason) == (
        8,
        "scale out 1 -> 8: lag 5000 / target 100 -> 50, capped at 8 by max_replicas",
    )


def test_activation_applies_only_from_zero_with_no_floor() -> None:
    a = _auto(min_replicas=0)
    d = a.decide(0, 0, 10, 8, 8)
    assert d == Decision(0, 0, 0, 10, 0, "keep 0: lag 10 <= activation 10: stay inactive")
    assert a.decide(1, 0, 11, 8, 8).reason == "scale out 0 -> 1: lag 11 / target 100 -> 1"
    # Running already: a lag under the activation threshold still counts.
    assert _auto(min_replicas=0).decide(0, 1, 5, 8, 8).recommendation == 1
    # A floor above zero: the pool starts whatever the lag.
    d = _auto(min_replicas=2).decide(0, 0, 5, 8, 8)
    assert (d.desired, d.recommendation) == (2, 2)


def test_a_failed_query_keeps_the_size_and_restarts_the_scale_in_window() -> None:
    a = _auto()
    assert a.decide(0, 1, 800, 8, 8).desired == 8
    d = a.decide(50, 8, None, 8, 8)
    assert d == Decision(
        50,
        8,
        8,
        None,
        None,
        "keep 8: lag unknown (query failed); a failed query is not a lag of zero",
    )
    assert d.needed is None
    # The backlog is gone, but the window of measurements starts again at the first one
    # after the failure (t=100): no scale-in until t=160.
    first = a.decide(100, 8, 0, 8, 8)
    assert first.desired == 8
    assert (
        first.reason == "keep 8: lag 0 / target 100 -> 0; not yet a full scale-in window of history"
    )
    assert a.decide(159, 8, 0, 8, 8).desired == 8
    assert a.decide(160, 8, 0, 8, 8).desired == 1


def test_the_scale_in_window_is_inclusive_at_its_edge() -> None:
    a = _auto()  # scale-in window 60 s
    assert a.decide(0, 8, 800, 8, 8).reason == "keep 8: lag 800 / target 100 -> 8"
    # At t=60 the t=0 recommendation (8) is still in the window: hold.
    d = a.decide(60, 8, 0, 8, 8)
    assert d.desired == 8
    assert d.reason == "keep 8: lag 0 / target 100 -> 0; scale-in window 60s not yet calm"
    # At t=61 it has left: the highest recommendation since is 1.
    d = a.decide(61, 8, 0, 8, 8)
    assert (d.desired, d.reason) == (1, "scale in 8 -> 1: lag 0 / target 100 -> 0")


def test_scale_in_goes_to_the_highest_recommendation_of_the_window() -> None:
    a = _auto()
    a.decide(0, 8, 800, 8, 8)
    a.decide(30, 8, 350, 8, 8)  # 4
    a.decide(50, 8, 150, 8, 8)  # 2
    d = a.decide(75, 8, 0, 8, 8)  # the window (15..75) holds 4, 2 and 1
    assert (d.desired, d.reason) == (4, "scale in 8 -> 4: lag 0 / target 100 -> 0")


def test_the_scale_out_window_is_inclusive_at_its_edge() -> None:
    a = _auto(scale_out_window_s=10)
    a.decide(0, 2, 150, 8, 8)  # recommends 2, the current size
    d = a.decide(5, 2, 800, 8, 8)  # 8 now, but 2 is in the window: wait
    assert (d.desired, d.reason) == (
        2,
        "keep 2: lag 800 / target 100 -> 8; waiting out the scale-out window",
    )
    assert a.decide(10, 2, 800, 8, 8).desired == 2  # t=0 is still in (10 - 10)
    d = a.decide(11, 2, 800, 8, 8)
    assert (d.desired, d.reason) == (8, "scale out 2 -> 8: lag 800 / target 100 -> 8")


def test_busy_engines_hold_replicas_against_scale_in() -> None:
    a = _auto()
    a.decide(0, 4, 350, 8, 8)
    # 1.6 replicas' worth at 0.8 each is exactly 2 (1.6 / 0.8 is 2.0000000000000004).
    d = a.decide(61, 4, 0, 8, 8, busy=1.6)
    assert d == Decision(
        61,
        4,
        2,
        0,
        1,
        "scale in 4 -> 2: lag 0 / target 100 -> 0; engines busy 1.60 replicas' worth / target "
        "0.8 -> hold 2",
        needed=2,
    )
    assert _auto().decide(0, 4, 0, 8, 8, busy=1.61).needed == 3
    assert _auto().decide(0, 4, 0, 8, 8, busy=0.0).needed == 0
    assert _auto().decide(0, 4, 0, 8, 8, busy=100.0).needed == 8  # never past the cap
    assert _auto().decide(0, 4, 0, 8, 8).needed is None  # not measured
    # Below the lag's recommendation, the load changes nothing (and says nothing).
    d = _auto().decide(0, 1, 350, 8, 8, busy=0.5)
    assert (d.needed, d.desired, d.reason) == (1, 4, "scale out 1 -> 4: lag 350 / target 100 -> 4")


def test_busy_never_grows_the_pool() -> None:
    d = _auto().decide(0, 1, 0, 8, 8, busy=5.0)
    assert (d.needed, d.desired) == (7, 1)
    assert d.reason.startswith("keep 1: lag 0 / target 100 -> 0; engines busy 5.00")


def test_the_cap_holds_against_the_window() -> None:
    a = _auto()
    a.decide(0, 8, 800, 8, 8)
    # Partitions went from 8 to 4: the window would hold 8, the cap does not allow it.
    d = a.decide(5, 8, 800, 4, 8)
    assert (d.desired, d.reason) == (
        4,
        "scale in 8 -> 4: above the cap (lag 800 / target 100 -> 8, capped at 4 by partitions)",
    )


def test_the_floor_holds_against_the_window() -> None:
    a = _auto(min_replicas=3, scale_out_window_s=30)
    assert a.decide(0, 1, 0, 8, 1).desired == 1  # one GPU: the floor is 1
    # GPUs came back: the floor is 3; the scale-out window still remembers 1.
    d = a.decide(5, 1, 0, 8, 8)
    assert (d.desired, d.reason) == (3, "scale out 1 -> 3: below min_replicas")


# ----------------------------------------------------------------------------- edges
# The exact inputs where a comparison or a constant decides: a lag of 0, 1 and below zero,
# a load that needs exactly the lag's recommendation, a pool that already has the size its
# window agrees on, and each of the three limits of the cap on its own.


def test_without_a_floor_no_lag_asks_for_nothing_and_one_record_for_one() -> None:
    a = _auto(min_replicas=0)
    assert a.recommend(0, 8, 8) == (0, "lag 0 / target 100 -> 0")
    assert a.recommend(1, 8, 8) == (1, "lag 1 / target 100 -> 1")
    # Committed offsets a little past a stale end offset: a negative lag asks for nothing,
    # never for a negative pool.
    assert a.recommend(-150, 8, 8) == (0, "lag -150 / target 100 -> 0")


def test_no_partitions_caps_the_pool_at_zero_whatever_the_floor() -> None:
    d = _auto(min_replicas=1).decide(0, 1, 5000, 0, 8)
    assert (d.desired, d.recommendation) == (0, 0)
    assert d.reason == (
        "scale in 1 -> 0: above the cap (lag 5000 / target 100 -> 50, capped at 0 by partitions)"
    )


@pytest.mark.parametrize(
    ("max_replicas", "partitions", "gpus", "cap"),
    [(3, 8, 6, 3), (8, 2, 6, 2), (8, 6, 1, 1)],
    ids=["max_replicas", "partitions", "gpus"],
)
def test_each_limit_alone_caps_the_recommendation_and_the_load(
    max_replicas: int, partitions: int, gpus: int, cap: int, request: pytest.FixtureRequest
) -> None:
    a = _auto(max_replicas=max_replicas)
    limit = request.node.callspec.id
    assert a.recommend(5000, partitions, gpus) == (
        cap,
        f"lag 5000 / target 100 -> 50, capped at {cap} by {limit}",
    )
    d = a.decide(0, 1, 0, partitions, gpus, busy=100.0)
    assert (d.needed, d.desired) == (cap, 1)


def test_a_load_that_needs_exactly_the_recommendation_says_nothing() -> None:
    # 3.2 replicas' worth at 0.8 each is exactly 4 (3.2 / 0.8 is 4.000000000000001).
    d = _auto().decide(0, 4, 350, 8, 8, busy=3.2)
    assert d == Decision(0, 4, 4, 350, 4, "keep 4: lag 350 / target 100 -> 4", needed=4)


def test_a_pool_of_the_size_its_window_agrees_on_just_keeps_it() -> None:
    a = _auto()
    a.decide(0, 4, 350, 8, 8)
    # A whole window later the recommendation is still the current size: no scale-in
    # pending, so the reason names no window.
    d = a.decide(61, 4, 350, 8, 8)
    assert (d.desired, d.reason) == (4, "keep 4: lag 350 / target 100 -> 4")
    d = a.decide(62, 4, 350, 8, 8, busy=3.2)
    assert (d.desired, d.reason) == (4, "keep 4: lag 350 / target 100 -> 4")

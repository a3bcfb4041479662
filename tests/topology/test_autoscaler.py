"""The autoscaling decision: KEDA-like sizing, activation, caps, stabilization windows,
and a failed lag query that never reads as zero."""

from __future__ import annotations

import pytest

from topology.autoscaler import Autoscaler, Policy

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

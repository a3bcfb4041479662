"""The controller's decision rules without Ray or Kafka: the busy hold against scale-in,
a failed lag query that resets the scale-in window, and a simulated pool under steady
load (why lag alone flaps and the busy hold does not)."""

from __future__ import annotations

import pytest

from dgstream.topology.autoscaler import Autoscaler, Policy

pytestmark = pytest.mark.unit


def _auto(**kw: object) -> Autoscaler:
    base: dict[str, object] = {
        "min_replicas": 1,
        "max_replicas": 8,
        "target_lag_per_replica": 100,
        "activation_lag": 0,
        "scale_out_window_s": 0,
        "scale_in_window_s": 20,
    }
    base.update(kw)
    return Autoscaler(Policy(**base))  # type: ignore[arg-type]


def test_busy_engines_hold_replicas_against_scale_in() -> None:
    a = _auto()
    assert a.decide(0, 1, 800, 8, 8, busy=0.9).desired == 8
    # The backlog is gone, but the load keeps 3.6 replicas' worth of engines busy.
    for t in range(2, 60, 2):
        d = a.decide(t, 8, 20, 8, 8, busy=3.6)
    assert d.desired == 5, d.reason  # ceil(3.6 / 0.8)
    assert "hold 5" in d.reason
    assert d.needed == 5


def test_busy_never_scales_out() -> None:
    a = _auto()
    d = a.decide(0, 2, 50, 8, 8, busy=7.5)  # busy asks for 8, the lag for 1
    assert d.desired == 2 and not d.changes, d.reason


def test_busy_hold_respects_the_cap() -> None:
    a = _auto(max_replicas=4)
    for t in range(0, 40, 2):
        d = a.decide(t, 4, 0, 8, 8, busy=6.0)
    assert d.desired == 4 and d.needed == 4


def test_unknown_lag_restarts_the_scale_in_window() -> None:
    a = _auto()
    for t in range(0, 30, 2):
        a.decide(t, 3, 0, 8, 8, busy=0.0)  # a calm window: scale-in is due ...
    for t in range(30, 60, 2):
        d = a.decide(t, 3, None, 8, 8, error="NoBrokersAvailable")
        assert d.desired == 3 and "lag unknown" in d.reason  # ... but never on no data
    # Back: a whole window of measurements before scaling in.
    for t in range(60, 80, 2):
        d = a.decide(t, 3, 0, 8, 8, busy=0.0)
        assert d.desired == 3, (t, d.reason)
    assert a.decide(80, 3, 0, 8, 8, busy=0.0).desired == 1


def _simulate(use_busy: bool, seconds: int = 600) -> tuple[int, int, list[int]]:
    """A pool under a steady 45 requests/s, 12 per replica (about half the capacity of 8),
    new replicas ready 16 s after they are asked for; the controller polls every 2 s.
    Returns (scaling decisions in the first minute, after it, the sizes after it)."""
    rate, per_replica, start_s, poll = 45.0, 12.0, 16, 2
    a = _auto()
    lag, ready_at = 0.0, [0.0]  # one entry per replica: when it can serve
    early = late = 0
    sizes: list[int] = []
    for t in range(0, seconds, poll):
        ready = sum(1 for r in ready_at if r <= t)
        served = min(lag + rate * poll, ready * per_replica * poll)
        lag += rate * poll - served
        busy = served / poll / per_replica if use_busy else None
        d = a.decide(float(t), len(ready_at), int(lag), 8, 8, busy=busy)
        if d.desired > len(ready_at):
            ready_at += [t + start_s] * (d.desired - len(ready_at))
        else:
            ready_at = sorted(ready_at)[: d.desired]
        if t < 60:
            early += d.changes
        else:
            late += d.changes
            sizes.append(d.desired)
    return early, late, sizes


def test_lag_alone_flaps_under_steady_load_and_the_busy_hold_does_not() -> None:
    _, late_lag_only, _ = _simulate(use_busy=False)
    _, late_busy, sizes = _simulate(use_busy=True)
    # Lag alone: the pool keeps up, the lag vanishes, the pool shrinks, the lag builds up.
    assert late_lag_only >= 10
    # With the hold: at most the one scale-in from the ramp's overshoot, then steady at
    # ceil(45 / 12 / 0.8) = 5.
    assert late_busy <= 1
    assert sizes[-1] == 5

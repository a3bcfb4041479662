"""The controller's restart backoff on a fake clock: the first restart at once, then pauses
doubling from the initial one up to the cap; forgotten only after a replica served for the
reset window in a row."""

from __future__ import annotations

import pytest

from dgstream.topology.restarts import RestartBackoff

pytestmark = pytest.mark.unit


def test_pauses_double_up_to_the_cap() -> None:
    b = RestartBackoff(initial_s=5, max_s=60, reset_after_s=300)
    now, pauses = 0.0, []
    for _ in range(8):
        due = b.failed(3, now)
        pauses.append(due - now)
        now = due + 1  # it starts, and fails a second later
    assert pauses == [0, 5, 10, 20, 40, 60, 60, 60]
    assert b.failures(3) == 8
    assert b.failures(4) == 0  # per replica


def test_a_replica_that_serves_long_enough_is_forgiven() -> None:
    b = RestartBackoff(initial_s=5, max_s=60, reset_after_s=100)
    b.failed(0, 0.0)
    b.failed(0, 1.0)
    # Ready now and then, but never for the whole window in a row: still failing.
    for t in (10.0, 50.0, 105.0):
        b.ready(0, t)
        if t == 50.0:
            b.not_ready(0)
    assert b.failures(0) == 2
    b.ready(0, 106.0)
    b.ready(0, 206.0)
    assert b.failures(0) == 0
    assert b.failed(0, 300.0) == 300.0  # at once again


def test_scale_in_forgets() -> None:
    b = RestartBackoff(initial_s=1, max_s=2, reset_after_s=10)
    b.failed(1, 0.0)
    b.forget(1)
    assert b.failures(1) == 0

"""Waiting on a condition, never on the clock alone (shared by every test tier)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest


def wait_for(
    predicate: Callable[[], Any], timeout_s: float = 60.0, what: str = "", every_s: float = 0.05
) -> Any:
    """Poll `predicate` until it returns something truthy (and return that); fail the test
    after `timeout_s`, naming `what` it waited for."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout_s}s waiting for {what or predicate}")
        time.sleep(every_s)

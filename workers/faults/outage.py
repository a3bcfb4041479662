"""Outages: the engine or the output topic out of reach. Not bad input: nothing is
dead-lettered because of one. The worker abandons its open work (read again later), stops
taking new work, and tries again after a capped exponential backoff, for at most the
budget; the first batch that goes through ends the outage.

`Outage` is what the engine loop reports; `OutageClock` is the backoff (plain data, the
clock injected, so it is tested without waiting).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Literal

from kafka.errors import KafkaError, KafkaTimeoutError

from dgstream.workers.hosting.settings import OutageTuning

__all__ = ["Outage", "OutageClock", "OutageKind", "produce_outage"]

OutageKind = Literal["engine", "output"]


class Outage(Exception):
    """A batch could not be finished because something it needs is out of reach."""

    def __init__(self, kind: OutageKind, message: str) -> None:
        super().__init__(f"{kind} unavailable: {message}")
        self.kind = kind
        self.message = message


def produce_outage(exc: BaseException) -> Outage | None:
    """An Outage for a produce error that waiting may cure (no leader, not enough
    replicas, a timeout, the broker out of reach); None for the others."""
    if isinstance(exc, KafkaTimeoutError) or (
        isinstance(exc, KafkaError) and getattr(exc, "retriable", False)
    ):
        return Outage("output", f"{type(exc).__name__}: {exc}"[:500])
    return None


class OutageClock:
    """The current outage, if any: since when, how many tries, when to try again."""

    def __init__(self, tuning: OutageTuning, clock: Callable[[], float] = time.monotonic) -> None:
        self._tuning = tuning
        self._clock = clock
        self.kind: OutageKind | None = None
        self.since: float | None = None
        self.tries = 0
        self.retry_at = 0.0
        self.error = ""

    @property
    def active(self) -> bool:
        return self.since is not None

    def hit(self, outage: Outage) -> float:
        """Another failed try; returns the pause before the next one."""
        now = self._clock()
        if self.since is None:
            self.since = now
        self.kind, self.error = outage.kind, outage.message
        self.tries += 1
        t = self._tuning
        pause = min(t.initial_backoff_s * 2 ** (self.tries - 1), t.max_backoff_s)
        self.retry_at = now + pause
        return pause

    def exhausted(self) -> bool:
        """The outage has lasted longer than the budget."""
        return self.since is not None and self._clock() - self.since > self._tuning.budget_s

    def holding(self) -> bool:
        """Within the pause before the next try: take no new work."""
        return self.since is not None and self._clock() < self.retry_at

    def clear(self) -> float:
        """A try went through: the outage is over; returns how long it lasted."""
        lasted = 0.0 if self.since is None else self._clock() - self.since
        self.kind, self.since, self.tries, self.retry_at, self.error = None, None, 0, 0.0, ""
        return lasted

    def status(self) -> dict[str, Any] | None:
        if self.since is None:
            return None
        now = self._clock()
        return {
            "kind": self.kind,
            "for_s": round(now - self.since, 3),
            "tries": self.tries,
            "next_try_in_s": round(max(0.0, self.retry_at - now), 3),
            "budget_s": self._tuning.budget_s,
            "error": self.error,
        }

"""What a replica tells its controller, as one typed object, and how a worker knows it is
stalled.

`WorkerActor.report()` returns a `ReplicaReport`; the controller reads only that (its
state, whether it serves, and the counters its throughput and busy figures come from).
`WorkerActor.status()` stays the fuller dict that operators, the CLI and the tests read.

Progress (docs/operations.md, "Health: STALLED and FAILING"): a partition makes progress
when its committed offset moves. A partition is *held* while the worker has records of it
that it polled and has not committed (in the batch being filled, in the engine, waiting
for their acknowledgement or for the commit). A held partition whose committed offset has
not moved for `stall_after_s`, counted from when its oldest held batch started if that is
later, has stalled; so has a consumer thread that has not polled for that long while the
worker owns lag. Backlog the consumer is never given is never held: transaction markers,
aborted records, records of a transaction still open upstream (read_committed), or a
partition paused while the worker is full. An outage is not a stall either: its work is
abandoned and retried on a backoff that status() shows as the outage.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from dgstream.workers.steps.batches import tp_name

__all__ = ["ProgressClock", "ReplicaReport", "Stall", "StallWatch"]


@dataclass(frozen=True)
class Stall:
    """Why a worker counts as stalled: the held partitions without progress (seconds each),
    and how long its consumer thread has not polled when that is too long."""

    partitions: dict[str, float] = field(default_factory=dict)
    not_polled_s: float | None = None
    lag: dict[str, int] = field(default_factory=dict)  # the owned partitions' last known lag

    @property
    def for_s(self) -> float:
        """The longest time without progress among the reasons."""
        return max([*self.partitions.values(), self.not_polled_s or 0.0])

    def describe(self) -> str:
        """One line for operators, e.g. `no progress for 125 s on in-0 (lag 9), in-3 (lag 2)`."""
        parts = []
        if self.partitions:
            worst = sorted(self.partitions, key=lambda p: (-self.partitions[p], p))
            shown = ", ".join(f"{p} (lag {self.lag[p]})" if p in self.lag else p for p in worst[:4])
            more = f" and {len(worst) - 4} more" if len(worst) > 4 else ""
            longest = self.partitions[worst[0]]
            parts.append(f"no progress for {longest:.0f} s on {shown}{more}")
        if self.not_polled_s is not None:
            total = sum(self.lag.values())
            parts.append(f"the consumer has not polled for {self.not_polled_s:.0f} s (lag {total})")
        return "; ".join(parts)


class ProgressClock:
    """When each held partition last made progress; thread-safe (status() runs on Ray's
    threads while the consumer thread works).

    A commit is noticed when the clock is read (every status() or report(): the controller
    reads one every poll), so a partition's progress time is late by at most one poll. A
    partition seen held for the first time counts from when its oldest held batch started,
    so the first read after a long quiet spell is right too."""

    def __init__(self, stall_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.stall_after_s = stall_after_s
        self._clock = clock
        self._lock = threading.Lock()
        self._committed: dict[str, int | None] = {}  # per held partition, at the last read
        self._moved_at: dict[str, float] = {}  # when its committed offset was seen to move

    def read(
        self,
        held: Mapping[str, float],
        committed: Mapping[str, int],
        *,
        excused: bool = False,
        last_poll: float | None = None,
        lag: Mapping[str, int] | None = None,
    ) -> tuple[dict[str, float], Stall | None]:
        """`held`: partition -> when its oldest held batch started (this clock's time);
        `committed`: the committed offsets; `excused`: an outage is under way (its backoff
        is no stall: every partition counts from now); `last_poll`: when the consumer thread
        last polled (None: unknown); `lag`: the owned partitions' last known lag.

        Returns (seconds without progress per held partition, the stall or None)."""
        now = self._clock()
        lag = dict(lag or {})
        with self._lock:
            for p in list(self._committed):
                if p not in held:  # nothing held: its clock starts again with new work
                    del self._committed[p]
                    self._moved_at.pop(p, None)
            waited: dict[str, float] = {}
            for p, started in held.items():
                offset = committed.get(p)
                if excused or (p in self._committed and self._committed[p] != offset):
                    self._moved_at[p] = now
                self._committed[p] = offset
                since = max(started, self._moved_at.get(p, -math.inf))
                waited[p] = max(0.0, now - since)
        if excused:
            return waited, None
        stalled = {p: s for p, s in waited.items() if s >= self.stall_after_s}
        not_polled = None
        if last_poll is not None and (held or any(lag.values())):
            quiet = now - last_poll
            if quiet >= self.stall_after_s:
                not_polled = quiet
        if not stalled and not_polled is None:
            return waited, None
        shown_lag = {p: n for p, n in lag.items() if p in stalled or not_polled is not None}
        return waited, Stall(
            {p: round(s, 1) for p, s in stalled.items()},
            None if not_polled is None else round(not_polled, 1),
            shown_lag,
        )


class StallWatch:
    """A worker's progress clock, read from what its roles share (`workers.stream.shared.
    Shared`: the batches between poll and commit, the committed offsets, the outage, the
    lag) and from its consumer's last poll; it logs a stall when it starts and when it ends.
    Safe to call from any thread: it reads copies, as the consumer thread changes them."""

    def __init__(self, shared: Any, consumer: Callable[[], Any], state: Callable[[], str]) -> None:
        self._shared = shared
        self._consumer = consumer  # the worker's consumer once built (None before)
        self._state = state
        self.clock = ProgressClock(shared.settings.stall_after_s)
        self._shown: str | None = None  # the stall last logged, until progress resumes
        self._lock = threading.Lock()

    def status(self) -> dict[str, Any]:
        """For `StreamWorker.status()`: seconds without progress per held partition, and the
        stall once one of them (or the consumer's last poll) reaches stall_after_s."""
        waited, stall = self.read()
        return {
            "stall_after_s": self.clock.stall_after_s,
            "progress": {p: round(w, 1) for p, w in sorted(waited.items())},
            "stall": None
            if stall is None
            else {
                "reason": stall.describe(),
                "for_s": stall.for_s,
                "partitions": stall.partitions,
                "not_polled_s": stall.not_polled_s,
            },
        }

    def read(self) -> tuple[dict[str, float], Stall | None]:
        """(seconds without progress per held partition, the stall or None); None too while
        the worker is not running."""
        s = self._shared
        acc = s.acc
        held: dict[str, float] = {}
        for b in [*dict(s.offsets.pending).values(), *([acc] if acc is not None else [])]:
            # A tracked batch holds the partitions it has not been committed for yet; the
            # one being filled (not tracked yet) every partition it has records of.
            for tp in dict(b.last) if b is acc else set(b.open):
                name = tp_name(tp)
                held[name] = min(held.get(name, b.started), b.started)
        committed = {tp_name(tp): off for tp, off in dict(s.offsets.committed).items()}
        waited, stall = self.clock.read(
            held,
            committed,
            excused=s.outage.active,
            last_poll=self._last_poll(),
            lag=dict(s.metrics.lag),
        )
        if self._state() != "running":
            stall = None
        with self._lock:
            was, self._shown = self._shown, stall.describe() if stall else None
        if stall is not None and was is None:
            s.log.error("worker_stalled", reason=stall.describe(), for_s=stall.for_s)
        elif stall is None and was is not None:
            s.log.info("worker_progressing", was=was)
        return waited, stall

    def _last_poll(self) -> float | None:
        """When the consumer thread last called poll() (time.monotonic), as kafka-python's
        group coordinator records it for max_poll_interval_ms; None before the first poll
        or when the client does not say."""
        coordinator = getattr(self._consumer(), "_coordinator", None)
        last = getattr(getattr(coordinator, "heartbeat", None), "last_poll", None)
        if not isinstance(last, int | float) or not math.isfinite(last):
            return None
        return float(last)


@dataclass(frozen=True)
class ReplicaReport:
    state: str  # a `WorkerState`
    actor_id: str | None  # None outside Ray (a plain process)
    answered: int
    dead_lettered: int
    engine_seconds: float  # engine time since the actor (re)started
    error: str | None = None  # what the actor could not do (its Kafka login, say)
    # Why it stopped, as a code (`workers.faults.poll_errors.CAUSES`: a batch it cannot read);
    # None for other errors.
    cause: str | None = None
    # Running but stalled (`Stall.describe()`), and for how long; None when it progresses.
    stall: str | None = None
    stalled_for_s: float = 0.0

    @property
    def finished(self) -> int:
        """Requests done (answered or dead-lettered) since the actor (re)started."""
        return self.answered + self.dead_lettered

    @property
    def ready(self) -> bool:
        """Serving: running, reporting no error, and not stalled."""
        return self.state == "running" and not self.error and not self.stall

    @property
    def shown_state(self) -> str:
        """The state as operators see it, with the error (or the stall) when there is one."""
        if self.error:
            return f"{self.state}: {self.error}"
        if self.stall and self.state == "running":
            return f"stalled: {self.stall}"
        return self.state

    @property
    def done_consuming(self) -> bool:
        """Alive but no longer consuming (stopped from outside, or failed)."""
        return self.state in ("stopped", "failed")

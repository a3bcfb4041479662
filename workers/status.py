"""What a replica tells its controller, as one typed object.

`WorkerActor.report()` returns a `ReplicaReport`; the controller reads only that (its
state, whether it serves, and the counters its throughput and busy figures come from).
`WorkerActor.status()` stays the fuller dict that operators, the CLI and the tests read.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ReplicaReport"]


@dataclass(frozen=True)
class ReplicaReport:
    state: str  # a `WorkerState`
    actor_id: str | None  # None outside Ray (a plain process)
    answered: int
    dead_lettered: int
    engine_seconds: float  # engine time since the actor (re)started
    error: str | None = None  # what the actor could not do (its Kafka login, say)
    # Why it stopped, as a code (`workers.poll_errors.CAUSES`: a batch it cannot read);
    # None for other errors.
    cause: str | None = None

    @property
    def finished(self) -> int:
        """Requests done (answered or dead-lettered) since the actor (re)started."""
        return self.answered + self.dead_lettered

    @property
    def ready(self) -> bool:
        """Serving: running and reporting no error."""
        return self.state == "running" and not self.error

    @property
    def shown_state(self) -> str:
        """The state as operators see it, with the error when there is one."""
        return f"{self.state}: {self.error}" if self.error else self.state

    @property
    def done_consuming(self) -> bool:
        """Alive but no longer consuming (stopped from outside, or failed)."""
        return self.state in ("stopped", "failed")

"""The worker's own failures (engine and input errors are in `workers.engine.types` and
`schemas.errors`)."""

from __future__ import annotations

__all__ = ["WorkerFailed"]


class WorkerFailed(RuntimeError):
    """The worker stopped on an error that needs a restart (fatal engine error, an output
    that could not be produced, being fenced). Nothing in flight was committed."""

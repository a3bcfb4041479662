"""The worker's own failures (engine and input errors are in `workers.engine.types` and
`schemas.errors`)."""

from __future__ import annotations

__all__ = ["CommitRefused", "OutputFailed", "Redo", "WorkerFailed"]


class WorkerFailed(RuntimeError):
    """The worker stopped on an error that needs a restart (fatal engine error, an output
    that could not be produced, being fenced). Nothing in flight was committed."""


class CommitRefused(Exception):
    """This member may not commit what it holds: its group membership is stale (a
    generation reset, a partition no longer assigned, the coordinator refused the
    generation). Its open work must be abandoned (exactly-once: the transaction aborted)
    and read again from the committed offsets; the member itself carries on."""


class OutputFailed(CommitRefused):
    """Exactly-once: an output of the open transaction failed, so the transaction cannot
    be committed; it is aborted (if that fails too, the producer is unusable: the worker
    fails) and `cause` is handled as any produce error."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"an output of the transaction failed: {type(cause).__name__}: {cause}")
        self.cause = cause


class Redo(Exception):
    """A batch is to be read again at once: the broker refused one of its outputs (too
    large, a reply topic it may not write); that record is dead-lettered the next time,
    its neighbours answered."""

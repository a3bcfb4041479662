"""The worker's own failures (engine and input errors are in `workers.engine.types` and
`schemas.errors`). What each of them makes the worker do is one table:
`workers.stream.actions`."""

from __future__ import annotations

__all__ = ["CommitRefused", "OutputFailed", "SendFailed", "WorkerFailed"]


class WorkerFailed(RuntimeError):
    """The worker stopped on an error that needs a restart (fatal engine error, an output
    that could not be produced, being fenced). Nothing in flight was committed."""


class CommitRefused(Exception):
    """This member may not commit what it holds: its group membership is stale (a
    generation reset, a partition no longer assigned, the coordinator refused the
    generation). Its open work must be abandoned (exactly-once: the transaction aborted)
    and read again from the committed offsets; the member itself carries on."""


class SendFailed(Exception):
    """An output of a batch could not be sent: the broker refused it, or kafka-python
    refused to send it. `cause` is the client's error; whether waiting may cure it (an
    outage) or the batch is read again at once (the output check then refuses the record
    that does not fit) is the error table's call."""

    def __init__(self, cause: BaseException, what: str = "an output failed") -> None:
        super().__init__(f"{what}: {type(cause).__name__}: {cause}")
        self.cause = cause


class OutputFailed(SendFailed):
    """Exactly-once: an output of the open transaction failed, found when committing it,
    so the transaction cannot be committed; it is aborted (if that fails too, the producer
    is unusable: the worker fails) and `cause` is handled as any failed send."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(cause, "an output of the transaction failed")

"""The error table: every way a record, a read, a batch, a send, a commit, an abort or a
poll can end other than well, and what the worker does then. Plain data and one pure
function, no thread of its own: every role reads it.

`kind_of(exc)` names the kind of an error that reaches the consumer thread (a batch's, a
send's, a commit's); `TABLE[kind]` says what happens. The rows whose `by` is not
`workers.stream.recovery` are decided where the error arises (a dead letter is written by
the batch that holds the record; an engine call is retried inside the batch), and are here
so that the whole answer to "what does this error do?" is one table. docs/architecture.md
shows it rendered (`render()`), and a test keeps the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from dgstream.workers.engine.types import FatalEngineError
from dgstream.workers.faults.errors import CommitRefused, SendFailed, WorkerFailed
from dgstream.workers.faults.outage import Outage, produce_outage

__all__ = [
    "TABLE",
    "Action",
    "Kind",
    "Row",
    "counts_when_abandoned",
    "kind_of",
    "outage_of",
    "render",
]


class Action(Enum):
    RETRY = "retry"  # the same again (nothing is abandoned)
    BACK_OFF = "back off"  # an outage: abandon the open work, take none for a pause
    REDO = "redo"  # abandon the open work and read it again at once
    ABANDON = "abandon and re-read"  # the open work may not be committed by this member
    DEAD_LETTER = "dead letter"  # the record is refused, its neighbours answered
    FAIL = "fail the replica"  # stop; Ray restarts it; nothing uncommitted is kept


class Kind(Enum):
    BAD_INPUT = "bad input"
    POISON = "poison"
    REQUEST_FAILS = "request fails"
    RESULT_UNFIT = "result unfit"
    ENGINE_ERROR = "engine error"
    ENGINE_DOWN = "engine down"
    ENGINE_BROKEN = "engine broken"
    BUG = "bug"
    OUTPUT_DOWN = "output down"
    OUTPUT_REFUSED = "output refused"
    COMMIT_NOT_NOW = "commit not now"
    MEMBERSHIP_STALE = "membership stale"
    FATAL = "fatal"
    ABORT_FAILED = "abort failed"
    UNREADABLE_BATCH = "unreadable batch"


@dataclass(frozen=True)
class Row:
    ends: str  # what it ends: a record, a read, a batch, a send, a commit, an abort, a poll
    error: str  # what it is
    action: Action
    then: str  # what follows, and when the action changes
    by: str  # the module that acts on it


_RECOVERY = "workers.stream.recovery"

TABLE: dict[Kind, Row] = {
    Kind.BAD_INPUT: Row(
        "a record",
        "not a request: `parse_request` refused it, or it names an unknown question set",
        Action.DEAD_LETTER,
        "its code and message, the original bytes",
        "workers.stream.intake",
    ),
    Kind.POISON: Row(
        "a record",
        "it was running alone when `poison.poison_after` incarnations died",
        Action.DEAD_LETTER,
        "`POISON`, without running it again",
        "workers.stream.intake",
    ),
    Kind.REQUEST_FAILS: Row(
        "a read",
        "one request keeps failing alone (`ReadRejected`; a recoverable error past the "
        "retries) while the engine answers others",
        Action.DEAD_LETTER,
        "`ENGINE_FAILED`",
        "workers.steps.classify",
    ),
    Kind.RESULT_UNFIT: Row(
        "a record",
        "its result is larger than its topic takes, or its `reply_topic` is refused",
        Action.DEAD_LETTER,
        "`OUTPUT_TOO_LARGE`, `REPLY_TOPIC_*`",
        "workers.steps.outputs",
    ),
    Kind.ENGINE_ERROR: Row(
        "a read",
        "`RecoverableEngineError` on the batch's engine call",
        Action.RETRY,
        "`engine_retries` times, the pause doubling; then split the batch in halves",
        "workers.steps.classify",
    ),
    Kind.ENGINE_DOWN: Row(
        "a batch",
        "`Outage` of the engine: `EngineUnavailable`, or every call failing, a probe too",
        Action.BACK_OFF,
        "pauses doubling up to `outage.max_backoff_s`; past `outage.budget_s`: fail",
        _RECOVERY,
    ),
    Kind.ENGINE_BROKEN: Row(
        "a batch",
        "`FatalEngineError`",
        Action.FAIL,
        "even when the batch was abandoned meanwhile",
        _RECOVERY,
    ),
    Kind.BUG: Row(
        "a batch",
        "any other exception in the engine stage",
        Action.FAIL,
        "unless the batch was abandoned meanwhile",
        _RECOVERY,
    ),
    Kind.OUTPUT_DOWN: Row(
        "a send",
        "a timeout or a retriable Kafka error (no leader, not enough replicas)",
        Action.BACK_OFF,
        "as an engine outage; at-least-once: a new producer first",
        _RECOVERY,
    ),
    Kind.OUTPUT_REFUSED: Row(
        "a send",
        "any other Kafka error: the broker refused the record for good",
        Action.REDO,
        "the output check now refuses that record; more than 3 in a row: back off; "
        "at-least-once: a new producer first",
        _RECOVERY,
    ),
    Kind.COMMIT_NOT_NOW: Row(
        "a commit",
        "at-least-once: the consumer's commit failed (a rebalance under way)",
        Action.RETRY,
        "on the next pass; the batches stay tracked",
        "workers.commit",
    ),
    Kind.MEMBERSHIP_STALE: Row(
        "a commit",
        "`CommitRefused` (generation reset, partition no longer assigned, refused "
        "generation), or the member id changed under the open work",
        Action.ABANDON,
        "exactly-once: the transaction aborted",
        _RECOVERY,
    ),
    Kind.FATAL: Row(
        "a commit",
        "`WorkerFailed`: fenced, or a transaction's outcome unknown (a commit that timed out)",
        Action.FAIL,
        "the next incarnation aborts the open transaction",
        _RECOVERY,
    ),
    Kind.ABORT_FAILED: Row(
        "an abort",
        "exactly-once: the abort itself failed, the producer not fenced",
        Action.ABANDON,
        "a new producer before new work (it fences the old one); fenced: fail",
        "workers.stream.delivery",
    ),
    Kind.UNREADABLE_BATCH: Row(
        "a poll",
        "a record batch the consumer cannot read (`workers.faults.poll_errors`: a codec this "
        "process lacks, a CRC failure, bytes that do not decompress)",
        Action.FAIL,
        "after finishing and committing what was read before it, as a drain; the "
        "operator fixes the cause or skips the batch (`dgstream skip-batch`)",
        "workers.hosting.worker",
    ),
}


def kind_of(exc: BaseException) -> Kind:
    """The kind of an error that reached the consumer thread (a batch's, a send's, a
    commit's). A send's error counts by its cause; an error no row names is a bug. The
    tests below are disjoint (no error is two of them), so their order does not matter."""
    if isinstance(exc, SendFailed):
        return Kind.OUTPUT_DOWN if produce_outage(exc.cause) else Kind.OUTPUT_REFUSED
    if isinstance(exc, Outage):
        return Kind.ENGINE_DOWN if exc.kind == "engine" else Kind.OUTPUT_DOWN
    if produce_outage(exc) is not None:
        return Kind.OUTPUT_DOWN  # raised by a send itself (a metadata wait, max_block_ms)
    if isinstance(exc, CommitRefused):
        return Kind.MEMBERSHIP_STALE
    if isinstance(exc, FatalEngineError):
        return Kind.ENGINE_BROKEN
    if isinstance(exc, WorkerFailed):
        return Kind.FATAL
    return Kind.BUG


def counts_when_abandoned(exc: BaseException) -> bool:
    """Whether a batch abandoned meanwhile still reports `exc`: only a broken engine, which
    would break the next batch too; anything else of an abandoned batch is read again."""
    return kind_of(exc) is Kind.ENGINE_BROKEN


def outage_of(exc: BaseException) -> Outage:
    """The outage a BACK_OFF error stands for (its kind and message feed the backoff clock,
    status() and the metrics)."""
    if isinstance(exc, Outage):
        return exc
    outage = produce_outage(exc.cause if isinstance(exc, SendFailed) else exc)
    assert outage is not None, f"{exc!r} is no outage"
    return outage


def render() -> str:
    """The table as docs/architecture.md shows it (Markdown)."""
    lines = [
        "| ends | error | action | then | decided in |",
        "|---|---|---|---|---|",
    ]
    for row in TABLE.values():
        lines.append(
            f"| {row.ends} | {row.error} | **{row.action.value}** | {row.then} | `{row.by}` |"
        )
    return "\n".join(lines)

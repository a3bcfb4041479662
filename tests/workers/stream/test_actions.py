"""The error table (`workers.stream.actions`): which kind each error that reaches the
consumer thread is, what each kind does, and that docs/architecture.md shows the table as
the code has it."""

from __future__ import annotations

from pathlib import Path

import pytest
from kafka.errors import (
    CommitFailedError,
    KafkaError,
    KafkaTimeoutError,
    MessageSizeTooLargeError,
    NotEnoughReplicasError,
    TopicAuthorizationFailedError,
)

from dgstream.workers.engine.types import (
    EngineConfigError,
    FatalEngineError,
    RecoverableEngineError,
)
from dgstream.workers.faults.errors import CommitRefused, OutputFailed, SendFailed, WorkerFailed
from dgstream.workers.faults.outage import Outage
from dgstream.workers.stream.actions import (
    TABLE,
    Action,
    Kind,
    counts_when_abandoned,
    kind_of,
    outage_of,
    render,
)

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]

ERRORS: list[tuple[BaseException, Kind, Action]] = [
    (Outage("engine", "refused"), Kind.ENGINE_DOWN, Action.BACK_OFF),
    (Outage("output", "no leader"), Kind.OUTPUT_DOWN, Action.BACK_OFF),
    (SendFailed(NotEnoughReplicasError()), Kind.OUTPUT_DOWN, Action.BACK_OFF),
    (SendFailed(KafkaTimeoutError()), Kind.OUTPUT_DOWN, Action.BACK_OFF),
    (SendFailed(MessageSizeTooLargeError()), Kind.OUTPUT_REFUSED, Action.REDO),
    (SendFailed(TopicAuthorizationFailedError()), Kind.OUTPUT_REFUSED, Action.REDO),
    (SendFailed(RuntimeError("not Kafka's")), Kind.OUTPUT_REFUSED, Action.REDO),
    (OutputFailed(NotEnoughReplicasError()), Kind.OUTPUT_DOWN, Action.BACK_OFF),
    (OutputFailed(KafkaError("error state")), Kind.OUTPUT_REFUSED, Action.REDO),
    (NotEnoughReplicasError(), Kind.OUTPUT_DOWN, Action.BACK_OFF),
    (KafkaTimeoutError("max_block_ms"), Kind.OUTPUT_DOWN, Action.BACK_OFF),
    (KafkaError("raised by a send at once"), Kind.BUG, Action.FAIL),
    (CommitRefused("stale"), Kind.MEMBERSHIP_STALE, Action.ABANDON),
    (FatalEngineError("broken"), Kind.ENGINE_BROKEN, Action.FAIL),
    (EngineConfigError("bad"), Kind.ENGINE_BROKEN, Action.FAIL),
    (WorkerFailed("fenced"), Kind.FATAL, Action.FAIL),
    (ValueError("a bug"), Kind.BUG, Action.FAIL),
    (RecoverableEngineError("escaped the batch's retries"), Kind.BUG, Action.FAIL),
    (CommitFailedError("the at-least-once committer keeps it"), Kind.BUG, Action.FAIL),
]


@pytest.mark.parametrize(
    ("error", "kind", "action"), ERRORS, ids=[f"{type(e[0]).__name__}-{e[1].name}" for e in ERRORS]
)
def test_each_error_has_one_kind_and_one_action(
    error: BaseException, kind: Kind, action: Action
) -> None:
    assert kind_of(error) is kind
    assert TABLE[kind].action is action


def test_every_kind_has_its_row_and_every_action_is_used() -> None:
    assert list(TABLE) == list(Kind)
    assert {row.action for row in TABLE.values()} == set(Action)
    for kind, row in TABLE.items():
        assert row.ends and row.error and row.then, kind
        assert row.by.startswith("workers."), kind


def test_the_rows_the_consumer_thread_acts_on_are_recoverys() -> None:
    reach = {kind_of(error) for error, _, _ in ERRORS}
    assert {k for k, row in TABLE.items() if row.by == "workers.stream.recovery"} == reach


def test_only_a_broken_engine_counts_after_its_batch_was_abandoned() -> None:
    assert [e for e, _, _ in ERRORS if counts_when_abandoned(e)] == [
        e for e, kind, _ in ERRORS if kind is Kind.ENGINE_BROKEN
    ]


def test_an_outage_is_what_a_back_off_error_stands_for() -> None:
    engine = Outage("engine", "refused")
    assert outage_of(engine) is engine
    sent = outage_of(SendFailed(NotEnoughReplicasError("no ISR")))
    assert (sent.kind, sent.message) == (
        "output",
        "NotEnoughReplicasError: [Error 19] NotEnoughReplicasError: no ISR",
    )
    raised = outage_of(KafkaTimeoutError("metadata"))
    assert (raised.kind, raised.message) == (
        "output",
        "KafkaTimeoutError: KafkaTimeoutError: metadata",
    )
    with pytest.raises(AssertionError, match="is no outage"):
        outage_of(SendFailed(MessageSizeTooLargeError()))


def test_the_architecture_page_shows_the_table_as_the_code_has_it() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert render() in page
    lines = render().splitlines()
    assert lines[0] == "| ends | error | action | then | decided in |"
    assert len(lines) == 2 + len(TABLE)
    row = TABLE[Kind.OUTPUT_REFUSED]
    assert lines[2 + list(TABLE).index(Kind.OUTPUT_REFUSED)] == (
        f"| {row.ends} | {row.error} | **redo** | {row.then} | `workers.stream.recovery` |"
    )

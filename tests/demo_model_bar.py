"""What the committed demo model claims to pass, read from its own training log (issue #4).

`bench/train_demo_model.py` writes the held-out check of the saved weights into
`train_log.json`. A test of the demo model asserts the bar (accuracy >= 0.95) for each kind
the checkpoint reached there, and the ECE ceiling when it met it; the parts it has not
reached skip with the log's figures, and come back by themselves when a better checkpoint
lands. So a checkpoint that answers yes/no questions for real already proves the wiring of
yes/no answers, while choice is still being trained.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from workers import demo_tasks

KINDS = demo_tasks.KINDS


@dataclass(frozen=True)
class Claims:
    kinds: tuple[str, ...]  # kinds at or above the accuracy floor in the log's check
    ece: bool  # the log's ECE is within the ceiling
    summary: str  # the log's figures, for skip messages

    @property
    def everything(self) -> bool:
        return set(self.kinds) == set(KINDS) and self.ece


def committed_claims() -> Claims | None:
    """The committed checkpoint's claims, or None when no demo model is registered."""
    from workers.engine import models

    if "demo" not in models.SPECS:
        return None
    log = json.loads((models.TRAINED_DIRS["demo"] / "train_log.json").read_text())
    held = log.get("held_out", {})
    accuracy = held.get("accuracy", {})
    ece = held.get("ece")
    return Claims(
        kinds=tuple(k for k in KINDS if accuracy.get(k, 0.0) >= demo_tasks.ACCURACY_FLOOR),
        ece=ece is not None and ece <= demo_tasks.ECE_CEILING,
        summary=f"held out in its training log: accuracy {accuracy}, ECE {ece}",
    )


def assert_claims_hold(report: demo_tasks.CheckReport, claims: Claims) -> None:
    """Every claimed kind is at the floor on these reads, and the ECE when claimed."""
    for kind in claims.kinds:
        assert report.counts[kind] >= 50, report.counts
        assert report.accuracy[kind] >= demo_tasks.ACCURACY_FLOOR, (kind, report.summary())
    if claims.ece:
        assert report.ece <= demo_tasks.ECE_CEILING, report.summary()
    if claims.everything:
        assert report.passed, report.summary()


def assert_miswiring_caught(miswired: demo_tasks.CheckReport, claims: Claims) -> None:
    """A mis-wired result set fails the check, and every claimed kind falls far below
    the floor (not a near miss)."""
    assert not miswired.passed, miswired.summary()
    for kind in claims.kinds:
        assert miswired.accuracy[kind] < 0.8, (kind, miswired.summary())

"""The bar the committed demo model must pass, shared by its engine test and the
Kafka -> Ray -> Kafka test: every kind at accuracy >= 0.95 on enough questions, the ECE
within 0.05 (`topology.demo_tasks.check`), and a mis-wired result set failing the check far
below the floor, not by a near miss.

The bar is always measured here, on the model's own answers: never read from what the
training log says it scored.
"""

from __future__ import annotations

from dgstream.topology import demo_tasks

KINDS = demo_tasks.KINDS
MIN_QUESTIONS = 50  # per kind: below this an accuracy of 0.95 says little


def assert_bar_met(report: demo_tasks.CheckReport) -> None:
    for kind in KINDS:
        assert report.counts[kind] >= MIN_QUESTIONS, report.counts
    assert report.passed, report.summary()


def assert_miswiring_caught(miswired: demo_tasks.CheckReport) -> None:
    """A mis-wired result set fails the check, every kind falling far below the floor."""
    assert not miswired.passed, miswired.summary()
    for kind in KINDS:
        assert miswired.accuracy[kind] < 0.8, (kind, miswired.summary())

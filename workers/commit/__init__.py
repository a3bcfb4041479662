"""The commit path: offset tracking and the at-least-once and exactly-once committers."""

from dgstream.workers.commit.committers import (
    AtLeastOnceCommitter,
    Committer,
    ExactlyOnceCommitter,
    Marks,
)
from dgstream.workers.commit.offsets import OffsetTracker, Ready, commit_offsets

__all__ = [
    "AtLeastOnceCommitter",
    "Committer",
    "ExactlyOnceCommitter",
    "Marks",
    "OffsetTracker",
    "Ready",
    "commit_offsets",
]

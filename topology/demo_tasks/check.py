"""Results scored against the truth: per-kind accuracy and calibration (ECE), the bar the
demo model must pass."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from dgstream.schemas.kinds import name_of
from dgstream.topology.demo_tasks.generate import Example
from dgstream.topology.demo_tasks.images import IMAGE_KIND_OF, IMAGE_QUESTION_TYPES
from dgstream.topology.demo_tasks.words import KIND_OF, KINDS, QUESTION_TYPES

# Text and image question types (images.py) are scored alike.
_ALL_KIND_OF = {**KIND_OF, **IMAGE_KIND_OF}

# Accuracy per kind and calibration over held-out results, shared by the benchmark, the
# tests and the pipeline check. Results are wire results (dicts, or models with
# `model_dump`), matched to requests BY POSITION: result i answers request i.

ACCURACY_FLOOR = 0.95  # per kind
ECE_CEILING = 0.05
ECE_BINS = 15


@dataclass(frozen=True)
class ScoredRead:
    """One question of one request: what the result says against the truth."""

    kind: str
    task: str
    correct: bool
    confidence: float  # of the answer given (0 when the answer is missing)


@dataclass(frozen=True)
class CheckReport:
    accuracy: dict[str, float]  # kind -> accuracy
    counts: dict[str, int]  # kind -> questions
    ece: float
    passed: bool
    task_accuracy: dict[str, float]
    bins: list[tuple[float, float, float, int]]  # (low, mean confidence, accuracy, count)

    def summary(self) -> str:
        kinds = ", ".join(f"{k} {self.accuracy[k]:.3f} (n={self.counts[k]})" for k in self.accuracy)
        verdict = "PASS" if self.passed else "FAIL"
        return f"{verdict}: accuracy {kinds}; ECE {self.ece:.4f}"


def result_dict(result: Any) -> dict[str, Any]:
    if hasattr(result, "model_dump"):
        return dict(result.model_dump(mode="json"))
    return dict(result)


def answer_name(answer: Mapping[str, Any]) -> str | None:
    """The answer name a wire answer gives (`yes`/`no`, option, level), None if skipped."""
    return name_of(dict(answer))


def score_results(examples: Sequence[Example], results: Sequence[Any]) -> list[ScoredRead]:
    """Every question of every example against result i (by position). A missing result,
    an error or a missing answer counts as wrong with confidence 0."""
    out: list[ScoredRead] = []
    for i, ex in enumerate(examples):
        res = result_dict(results[i]) if i < len(results) else {}
        answers = res.get("answers") or {}
        for qid, want in ex.truth.items():
            task = ex.tasks[qid].task
            got = answers.get(qid)
            name = answer_name(got) if isinstance(got, Mapping) else None
            conf = float(got.get("confidence", 0.0)) if isinstance(got, Mapping) else 0.0
            out.append(ScoredRead(_ALL_KIND_OF[task], task, name == want, conf if name else 0.0))
    return out


def expected_calibration_error(
    reads: Sequence[ScoredRead], bins: int = ECE_BINS
) -> tuple[float, list[tuple[float, float, float, int]]]:
    """ECE over `bins` equal-width confidence bins ([0, 1/b), ..., [1 - 1/b, 1]), weighted by
    the share of reads in each; also each non-empty bin's (low edge, mean confidence,
    accuracy, count)."""
    table: list[tuple[float, float, float, int]] = []
    total = len(reads)
    ece = 0.0
    for b in range(bins):
        low, high = b / bins, (b + 1) / bins
        members = [
            r for r in reads if low <= r.confidence < high or (b == bins - 1 and r.confidence >= 1)
        ]
        if not members:
            continue
        conf = sum(r.confidence for r in members) / len(members)
        acc = sum(r.correct for r in members) / len(members)
        ece += len(members) / total * abs(acc - conf)
        table.append((low, conf, acc, len(members)))
    return ece, table


def check(reads: Sequence[ScoredRead]) -> CheckReport:
    """The demo model's accuracy check: at least 95% per kind and ECE at most 0.05."""
    accuracy: dict[str, float] = {}
    counts: dict[str, int] = {}
    for kind in KINDS:
        mine = [r for r in reads if r.kind == kind]
        counts[kind] = len(mine)
        accuracy[kind] = sum(r.correct for r in mine) / len(mine) if mine else 0.0
    task_accuracy = {}
    for task in (*QUESTION_TYPES, *IMAGE_QUESTION_TYPES):
        mine = [r for r in reads if r.task == task]
        if mine:
            task_accuracy[task] = sum(r.correct for r in mine) / len(mine)
    ece, bins = expected_calibration_error(reads)
    passed = (
        all(counts[k] > 0 and accuracy[k] >= ACCURACY_FLOOR for k in accuracy)
        and ece <= ECE_CEILING
    )
    return CheckReport(accuracy, counts, ece, passed, task_accuracy, bins)

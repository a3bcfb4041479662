"""Calibration: per-question temperature scaling, fitted from labelled results and applied to a
pipeline's results before its routes.

Why temperature (one number per question) rather than isotonic regression:
- it keeps every answer's label: a power of the probabilities never changes which is the
  largest, so a route on `label` or `choice` decides as before and only thresholds on
  probabilities move;
- it applies to all three kinds alike (yes/no, choice, score: `p_i^(1/T)`, renormalized, is
  a softmax of the label logits divided by T), where isotonic regression is binary and a
  one-vs-rest version can change the argmax and break the sum;
- one parameter fits from tens of labelled examples per question and cannot overfit the
  way a step function does; its negative log-likelihood is convex in 1/T, so the fit is a
  bisection with one answer.
What it cannot fix is a model that is wrong in one direction (too many yes at every
confidence): a bias needs a second parameter. docs/calibration.md shows both cases.

A calibration file (`Calibration`, JSON) holds, per question id, its kind, its answer names,
T, and what the fit measured (examples, NLL and ECE before and after). `Calibrator.apply`
replaces each calibrated answer's probabilities and keeps the engine's beside them
(`raw_p_yes`, `raw_probabilities`); `stderr`, `agreement` and the diagnostics' entropy stay
the engine's. A question whose kind or answer names differ from the file's is left raw.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from dgstream.schemas import ClassificationResult, QuestionKind, digest
from dgstream.schemas.kinds import get_kind, kind_of_type

__all__ = [
    "Calibration",
    "Calibrator",
    "Distribution",
    "Example",
    "QuestionCalibration",
    "distribution",
    "ece",
    "fit",
    "fit_temperature",
    "load_calibration",
    "nll",
    "smoothing_for",
    "tempered",
]

# Probabilities are written rounded to 6 decimals, so a 0 is anything below 5e-7; clipping
# at 1e-9 keeps its log finite without claiming more certainty than was written.
_FLOOR = 1e-9
# The range T is fitted in. 0.05..20 covers a model 20 times too sure or too unsure; past
# that the fit says more about the examples (all right, or all wrong) than about the model.
T_MIN, T_MAX = 0.05, 20.0
# Bisection steps on 1/T: the bracket shrinks 2^60-fold, far below any digit written.
_STEPS = 60
# 15 equal-width confidence bins: the demo model's own check (topology/demo_tasks/check.py).
ECE_BINS = 15
_DIGITS = 6


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


def _registered(kind: str) -> str:
    get_kind(kind)
    return kind


class QuestionCalibration(_Frozen):
    """One question's map, and what its fit measured on the examples it was fitted on."""

    # The question's kind by its name (`schemas.kinds`), which keys its map.
    kind: Annotated[QuestionKind, AfterValidator(_registered)]
    labels: list[str] = Field(min_length=2, description="Its answer names, in order.")
    temperature: float = Field(ge=T_MIN, le=T_MAX)
    examples: int = Field(ge=1)
    nll_before: float
    nll_after: float
    ece_before: float
    ece_after: float


class Calibration(_Frozen):
    """A calibration file: per question id, a temperature (`dgstream calibrate` writes it)."""

    schema_version: Literal[1] = 1
    method: Literal["temperature"] = "temperature"
    questions: dict[str, QuestionCalibration]
    created: datetime = Field(default_factory=lambda: datetime.now(UTC))
    source: str = Field(default="", description="Where the labelled examples came from.")

    @property
    def hash(self) -> str:
        """What a result's audit names: the hash of the whole file's content."""
        return digest(self.model_dump(mode="json"))


def load_calibration(path: str | Path) -> Calibration:
    """A calibration file (ValueError naming the file when it cannot be used)."""
    p = Path(path)
    try:
        return Calibration.model_validate_json(p.read_bytes())
    except OSError as exc:
        raise ValueError(f"{p}: cannot read the calibration file: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{p}: not a calibration file: {exc}") from None


# --------------------------------------------------------------------------- the map


def tempered(probs: Sequence[float], temperature: float) -> list[float]:
    """`probs` with temperature T: p_i^(1/T), renormalized (a softmax of log p / T)."""
    logs = np.log(np.clip(np.asarray(probs, dtype=np.float64), _FLOOR, 1.0)) / temperature
    logs -= logs.max()
    out = np.exp(logs)
    return list(out / out.sum())


def _round(values: Iterable[float]) -> list[float]:
    return [min(1.0, max(0.0, round(float(v), _DIGITS))) for v in values]


@dataclass(frozen=True)
class Distribution:
    """An answer as a distribution: its kind, answer names, probabilities (same order)."""

    kind: QuestionKind
    labels: tuple[str, ...]
    probs: tuple[float, ...]

    @property
    def answer(self) -> str:
        return self.labels[int(np.argmax(self.probs))]


def distribution(answer: Mapping[str, Any], *, raw: bool = True) -> Distribution | None:
    """The distribution a wire answer gives (ours or Jev's shape); `raw`: the engine's, when
    the answer was calibrated. None for a skipped or unreadable answer."""
    kind = kind_of_type(answer.get("type"))
    read = None if kind is None else kind.distribution(answer, raw)
    if kind is None or read is None:
        return None
    return Distribution(kind.name, *read)


class Calibrator:
    """Applies a `Calibration` to results (the worker, before its routes)."""

    def __init__(self, calibration: Calibration) -> None:
        self.calibration = calibration
        self.hash = calibration.hash
        self._maps = dict(calibration.questions)

    def apply(self, result: ClassificationResult) -> ClassificationResult:
        """`result` with each calibrated question's probabilities tempered, the engine's
        kept beside them; the same object when nothing applies."""
        changed: dict[str, Any] = {}
        for qid, answer in result.answers.items():
            q = self._maps.get(qid)
            if q is None:
                continue
            new = _calibrated(answer, q)
            if new is not None:
                changed[qid] = new
        if not changed:
            return result
        return result.model_copy(update={"answers": {**result.answers, **changed}})


def _calibrated(answer: Any, q: QuestionCalibration) -> Any:
    if answer.type != q.kind:  # another kind, or a skipped question
        return None
    t = q.temperature
    return get_kind(q.kind).calibrated(answer, q.labels, lambda p: _round(tempered(p, t)))


# --------------------------------------------------------------------------- the fit


@dataclass(frozen=True)
class Example:
    """One labelled answer: the engine's distribution and the true answer's index in it."""

    probs: tuple[float, ...]
    truth: int


def nll(examples: Sequence[Example], temperature: float = 1.0) -> float:
    """Mean negative log-likelihood of the true answers under temperature T."""
    total = 0.0
    for ex in examples:
        q = tempered(ex.probs, temperature)
        total -= math.log(max(q[ex.truth], _FLOOR))
    return total / len(examples)


def ece(examples: Sequence[Example], temperature: float = 1.0, bins: int = ECE_BINS) -> float:
    """Expected calibration error of the answer given (the most probable), over `bins`
    equal-width bins of its probability, weighted by the share of examples in each."""
    conf: list[float] = []
    right: list[bool] = []
    for ex in examples:
        q = tempered(ex.probs, temperature)
        top = int(np.argmax(q))
        conf.append(q[top])
        right.append(top == ex.truth)
    c, r = np.asarray(conf), np.asarray(right, dtype=np.float64)
    which = np.minimum((c * bins).astype(int), bins - 1)
    err = 0.0
    for b in range(bins):
        mask = which == b
        if mask.any():
            err += mask.sum() / len(c) * abs(r[mask].mean() - c[mask].mean())
    return float(err)


def smoothing_for(n: int) -> float:
    """The share of each target moved off the true answer, for `n` examples: half an
    example's worth (the Krichevsky-Trofimov estimate). Without it, a question whose
    answers are all right has no best temperature (the likelihood grows as T -> 0, claiming
    a certainty no finite sample shows); with it, the fit aims at a confidence of about
    (n + 0.5) / (n + 1) there, and it vanishes as examples grow."""
    return 0.5 / (n + 1)


def fit_temperature(examples: Sequence[Example], smoothing: float = 0.0) -> float:
    """The T in [T_MIN, T_MAX] that minimizes the cross-entropy to the true answers (each
    target keeps 1 - `smoothing` on its answer and spreads the rest over the others):
    bisection on the derivative in s = 1/T, which is increasing (convex in s)."""
    if not examples:
        raise ValueError("no examples to fit")
    logs = np.log(np.clip(np.asarray([e.probs for e in examples], dtype=np.float64), _FLOOR, 1.0))
    own = logs[np.arange(len(examples)), [e.truth for e in examples]]
    others = (logs.sum(axis=1) - own) / max(logs.shape[1] - 1, 1)
    truth = (1.0 - smoothing) * own + smoothing * others

    def slope(s: float) -> float:
        z = logs * s
        z -= z.max(axis=1, keepdims=True)
        w = np.exp(z)
        w /= w.sum(axis=1, keepdims=True)
        return float(((w * logs).sum(axis=1) - truth).mean())

    lo, hi = 1.0 / T_MAX, 1.0 / T_MIN
    if slope(hi) <= 0:  # sharper is always better: every example is right
        return T_MIN
    if slope(lo) >= 0:  # flatter is always better: the model knows nothing
        return T_MAX
    for _ in range(_STEPS):
        mid = math.sqrt(lo * hi)
        if slope(mid) > 0:
            hi = mid
        else:
            lo = mid
    return float(min(max(1.0 / math.sqrt(lo * hi), T_MIN), T_MAX))


def fit(
    labelled: Mapping[str, Sequence[tuple[Distribution, str]]],
    *,
    min_examples: int = 20,
    source: str = "",
) -> tuple[Calibration, dict[str, str]]:
    """A calibration from, per question id, (the engine's distribution, the true answer)
    pairs; and, per question left out, why (too few examples, answers that differ)."""
    out: dict[str, QuestionCalibration] = {}
    skipped: dict[str, str] = {}
    for qid, pairs in sorted(labelled.items()):
        if not pairs:
            continue
        first = pairs[0][0]
        same = [d for d, _ in pairs if d.kind == first.kind and d.labels == first.labels]
        if len(same) != len(pairs):
            skipped[qid] = "its results do not all have the same kind and answers"
            continue
        examples = [Example(d.probs, d.labels.index(t)) for d, t in pairs if t in d.labels]
        if len(examples) < len(pairs):
            skipped[qid] = "a label is not one of its answers: " + ", ".join(
                sorted({t for _, t in pairs if t not in first.labels})
            )
            continue
        if len(examples) < min_examples:
            skipped[qid] = f"{len(examples)} labelled examples; at least {min_examples} needed"
            continue
        t = fit_temperature(examples, smoothing=smoothing_for(len(examples)))
        out[qid] = QuestionCalibration(
            kind=first.kind,
            labels=list(first.labels),
            temperature=round(t, 6),
            examples=len(examples),
            nll_before=round(nll(examples), 6),
            nll_after=round(nll(examples, t), 6),
            ece_before=round(ece(examples), 6),
            ece_after=round(ece(examples, t), 6),
        )
    return Calibration(questions=out, source=source), skipped

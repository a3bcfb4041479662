"""From slot reads to answers (steps 3, 5 and 6 of the single-step read).

Per read and slot: the label distribution (softmax over the labels' logits), its entropy,
the mass the labels carry in the full distribution, and whether the full argmax is a label.
Over several reads of one question: the mean distribution, its confidence (max), the
standard error and the agreement of the reads' argmaxes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dgstream.workers.engine.types import SlotRead


def entropy(probs: np.ndarray) -> float:
    p = probs[probs > 0]
    return float(-(p * np.log(p)).sum())


def slot_read_from_label_logits(
    question_id: str,
    label_logits: np.ndarray,
    logsumexp_all: float | None = None,
    max_logit_all: float | None = None,
) -> SlotRead:
    """`label_logits` in label order; the full-vocabulary log-sum-exp and max when known."""
    z = label_logits.astype(np.float64)
    m = z.max()
    e = np.exp(z - m)
    probs = e / e.sum()
    mass: float | None = None
    is_label: bool | None = None
    if logsumexp_all is not None:
        lse_labels = m + math.log(e.sum())
        mass = float(min(1.0, math.exp(lse_labels - logsumexp_all)))
    if max_logit_all is not None:
        is_label = bool(m >= max_logit_all)
    return SlotRead(question_id, probs, entropy(probs), mass, is_label)


@dataclass(frozen=True)
class Aggregate:
    """Several reads of one question, combined."""

    mean: np.ndarray
    confidence: float
    argmax: int
    stderr: float | None  # of the chosen label's probability across reads
    agreement: float | None  # share of reads whose argmax is the chosen label
    entropy: float  # mean slot entropy over the reads
    label_mass: float | None
    reads: int


def aggregate(slot_reads: Sequence[SlotRead]) -> Aggregate:
    stack = np.stack([s.probs for s in slot_reads])
    mean = stack.mean(axis=0)
    mean = mean / mean.sum()
    top = int(mean.argmax())
    n = len(slot_reads)
    stderr = agreement = None
    if n > 1:
        stderr = round(float(stack[:, top].std(ddof=1) / math.sqrt(n)), 6)
        agreement = round(float((stack.argmax(axis=1) == top).mean()), 6)
    masses = [s.label_mass for s in slot_reads if s.label_mass is not None]
    return Aggregate(
        mean=mean,
        confidence=float(mean[top]),
        argmax=top,
        stderr=stderr,
        agreement=agreement,
        entropy=float(np.mean([s.entropy for s in slot_reads])),
        label_mass=float(np.mean(masses)) if masses else None,
        reads=n,
    )

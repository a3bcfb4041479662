"""The fields a condition reads (`question.field`), the values each can take, and what the
load-time checks know of a pipeline's questions; the error every part of the language raises."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any, Literal, NamedTuple

from schemas import QuestionKind
from workers.routes.tree import FieldRef

Kind = QuestionKind  # the contract's kinds
ValueType = Literal["number", "text", "bool"]
Value = float | str | bool | None  # None: unknown


class RouteError(ValueError):
    """A condition that cannot be used: what is wrong, and where (0-based character)."""

    def __init__(self, message: str, position: int | None = None) -> None:
        where = "" if position is None else f" (at character {position + 1})"
        super().__init__(f"{message}{where}")
        self.message = message
        self.position = position


class FieldSpec(NamedTuple):
    type: ValueType
    kinds: frozenset[Kind]  # the question kinds that have it
    low: float = -math.inf  # numbers: the range a value can take
    high: float = math.inf


_ALL: frozenset[Kind] = frozenset({"yes_no", "choice", "score"})
FIELDS: Mapping[str, FieldSpec] = {
    "p_yes": FieldSpec("number", frozenset({"yes_no"}), 0.0, 1.0),
    "confidence": FieldSpec("number", _ALL, 0.0, 1.0),
    # A score of n levels: 0..n-1 (Jev's score), 1..n (ours); n is at most 10.
    "score": FieldSpec("number", frozenset({"score"}), 0.0, 9.0),
    "expected_score": FieldSpec("number", frozenset({"score"}), 1.0, 10.0),
    "level": FieldSpec("text", frozenset({"score"})),
    "choice": FieldSpec("text", frozenset({"choice"})),
    "label": FieldSpec("text", _ALL),  # the answer's name, whatever the kind
    "entropy": FieldSpec("number", _ALL, 0.0),
    "label_mass": FieldSpec("number", _ALL, 0.0, 1.0),
    "stderr": FieldSpec("number", _ALL, 0.0, 1.0),
    "agreement": FieldSpec("number", _ALL, 0.0, 1.0),
    "skipped": FieldSpec("bool", _ALL),
}


class QuestionInfo(NamedTuple):
    """What the checks know of a question: its kind and answers (names)."""

    kind: Kind
    answers: tuple[str, ...]


def question_info(*question_sets: Mapping[str, Any]) -> dict[str, list[QuestionInfo]]:
    """Id -> what each set that has it says, from question models (`schemas.Question`)."""
    out: dict[str, list[QuestionInfo]] = {}
    for questions in question_sets:
        for qid, q in questions.items():
            out.setdefault(qid, []).append(QuestionInfo(q.kind, tuple(q.answers)))
    return out


def field_range(ref: FieldRef, infos: Sequence[QuestionInfo] | None) -> tuple[float, float]:
    spec = FIELDS[ref.name]
    sizes = [len(i.answers) for i in infos or () if i.kind == "score"]
    if ref.name == "score" and sizes:
        return 0.0, max(sizes) - 1.0
    if ref.name == "expected_score" and sizes:
        return 1.0, float(max(sizes))
    return spec.low, spec.high

"""The fields a condition reads (`question.field`), the values each can take, and what the
load-time checks know of a pipeline's questions; the error every part of the language raises."""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

from dgstream.schemas import QuestionKind
from dgstream.schemas.kinds import get_kind, kind_names, kinds
from dgstream.workers.routes.tree import FieldRef

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


# The fields every kind has (`label`: the answer's name, whatever the kind); each kind adds
# its own (`Kind.fields`: yes/no's p_yes, choice's choice, score's score, expected_score and
# level).
COMMON_FIELDS: Mapping[str, tuple[ValueType, float, float]] = {
    "confidence": ("number", 0.0, 1.0),
    "label": ("text", -math.inf, math.inf),
    "entropy": ("number", 0.0, math.inf),
    "label_mass": ("number", 0.0, 1.0),
    "stderr": ("number", 0.0, 1.0),
    "agreement": ("number", 0.0, 1.0),
    "skipped": ("bool", -math.inf, math.inf),
}


def _fields() -> dict[str, FieldSpec]:
    out: dict[str, FieldSpec] = {}
    for kind in kinds():
        for name, f in kind.fields.items():
            had = out.get(name)
            if had is not None and had.type != f.type:
                raise ValueError(f"route field {name!r} is a {had.type} and a {f.type}")
            owners = had.kinds | {kind.name} if had is not None else frozenset({kind.name})
            low = f.low if had is None else min(had.low, f.low)
            high = f.high if had is None else max(had.high, f.high)
            out[name] = FieldSpec(f.type, frozenset(owners), low, high)
    every = frozenset(kind_names())
    out.update(
        (name, FieldSpec(t, every, low, high)) for name, (t, low, high) in COMMON_FIELDS.items()
    )
    return out


class _Fields(Mapping[str, FieldSpec]):
    """The fields, read from the registry of kinds at each use (a kind may come later)."""

    def __getitem__(self, name: str) -> FieldSpec:
        return _fields()[name]

    def __iter__(self) -> Iterator[str]:
        return iter(_fields())

    def __len__(self) -> int:
        return len(_fields())


FIELDS: Mapping[str, FieldSpec] = _Fields()


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
    """A number field's range over the question's kinds that narrow it for its answers
    (a score's `score`: 0..n-1), else the field's."""
    spec = FIELDS[ref.name]
    ranges = [
        r
        for i in infos or ()
        if i.kind in spec.kinds
        and (r := get_kind(i.kind).field_range(ref.name, len(i.answers))) is not None
    ]
    if ranges:
        return min(r[0] for r in ranges), max(r[1] for r in ranges)
    return spec.low, spec.high

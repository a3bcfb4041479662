"""The load-time checks of a condition against what is known of the pipeline's questions:
names and kinds, texts that are no answer, comparisons the field's range decides (interval
analysis per comparison), and whole conditions that no answer makes true (`search`)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

from dgstream.workers.routes.fields import FIELDS, QuestionInfo, RouteError, field_range
from dgstream.workers.routes.parser import Condition
from dgstream.workers.routes.search import check_whole
from dgstream.workers.routes.tree import Compare, FieldRef, Num, Text, walk


def _check_field(ref: FieldRef, known: Mapping[str, Sequence[QuestionInfo]] | None) -> None:
    if known is None:
        return
    infos = known.get(ref.question)
    if infos is None:
        names = ", ".join(sorted(known)) or "none"
        raise RouteError(
            f"unknown question {ref.question!r} (the pipeline's question sets have: {names})",
            ref.pos,
        )
    kinds = FIELDS[ref.name].kinds
    if not any(i.kind in kinds for i in infos):
        have = "/".join(sorted({i.kind for i in infos}))
        want = " or ".join(sorted(kinds))
        raise RouteError(
            f"{ref} does not exist: {ref.name} is a field of {want} questions and "
            f"{ref.question} is {have}",
            ref.pos,
        )


def _check_text(ref: FieldRef, text: Text, op: str, infos: Sequence[QuestionInfo]) -> None:
    kinds = FIELDS[ref.name].kinds
    allowed = {a for i in infos if i.kind in kinds for a in i.answers}
    if text.value not in allowed:
        verdict = "false" if op == "==" else "true"
        raise RouteError(
            f"{ref} {op} {text.value!r} is {verdict} whatever the answer: {ref.question}'s "
            "answers are " + ", ".join(repr(a) for a in sorted(allowed)),
            text.pos,
        )


class _Interval(NamedTuple):
    low: float
    low_open: bool
    high: float
    high_open: bool

    def meet(self, other: _Interval) -> _Interval:
        low = max((self.low, self.low_open), (other.low, other.low_open))
        high = min((self.high, not self.high_open), (other.high, not other.high_open))
        return _Interval(low[0], low[1], high[0], not high[1])

    @property
    def empty(self) -> bool:
        return self.low > self.high or (self.low == self.high and (self.low_open or self.high_open))


_FLIP = {"<": ">", "<=": ">=", ">": "<", ">=": "<=", "==": "==", "!=": "!="}


def _allowed(op: str, c: float) -> _Interval | None:
    """The values v with `v op c` (None for !=, which no interval holds)."""
    return {
        "<": _Interval(-math.inf, True, c, True),
        "<=": _Interval(-math.inf, True, c, False),
        ">": _Interval(c, True, math.inf, True),
        ">=": _Interval(c, False, math.inf, True),
        "==": _Interval(c, False, c, False),
    }.get(op)


def _bounds(node: Compare) -> Iterable[tuple[FieldRef, str, float, Num]]:
    """(field, op, number) for each field-against-number pair of a chain, field first."""
    for k, op in enumerate(node.ops):
        a, b = node.operands[k], node.operands[k + 1]
        if isinstance(a, FieldRef) and isinstance(b, Num):
            yield a, op, b.value, b
        elif isinstance(a, Num) and isinstance(b, FieldRef):
            yield b, _FLIP[op], a.value, a


def _span(low: float, high: float) -> _Interval:
    """The values a field can take (an infinite end is open)."""
    return _Interval(low, low == -math.inf, high, high == math.inf)


def _verdict(ref: FieldRef, op: str, c: float, span: _Interval) -> str | None:
    """ "false" or "true" when `ref op c` cannot depend on the value, else None."""
    if op == "!=":
        inside = not span.meet(_Interval(c, False, c, False)).empty
        return None if inside else "true"
    ok = _allowed(op, c)
    assert ok is not None
    if span.meet(ok).empty:
        return "false"
    return "true" if span.meet(ok) == span else None


def _check_bounds(node: Compare, ranges: Mapping[str, tuple[float, float]]) -> None:
    """A comparison that the field's range decides (a threshold out of range, or one of its
    ends) is a mistake wherever it stands: a typo or a scale (confidence is 0..1, not %)."""
    for ref, op, c, num in _bounds(node):
        low, high = ranges[str(ref)]
        verdict = _verdict(ref, op, c, _span(low, high))
        if verdict is not None:
            raise RouteError(
                f"{ref} {op} {c:g} is {verdict} whatever the answer: {ref} lies in "
                f"{low:g}..{high:g}",
                num.pos,
            )


def check_condition(
    condition: Condition, known: Mapping[str, Sequence[QuestionInfo]] | None = None
) -> None:
    """The load-time checks (module docstring). `known`: the pipeline's questions by id
    (`question_info`), or None when its questions are not known (inline questions)."""
    refs = condition.fields()
    for ref in refs:
        _check_field(ref, known)
    ranges = {str(r): field_range(r, known.get(r.question) if known else None) for r in refs}
    for node in walk(condition.tree):
        if isinstance(node, Compare):
            _check_bounds(node, ranges)
            _check_texts(node, known)
    check_whole(condition.tree, known)


def _check_texts(node: Compare, known: Mapping[str, Sequence[QuestionInfo]] | None) -> None:
    if known is None:
        return
    for k, op in enumerate(node.ops):
        a, b = node.operands[k], node.operands[k + 1]
        if isinstance(a, Text) and isinstance(b, FieldRef):
            a, b = b, a
        if isinstance(a, FieldRef) and isinstance(b, Text):
            _check_text(a, b, op, known[a.question])

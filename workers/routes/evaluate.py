"""Three-valued evaluation: a field without a value is unknown, a comparison with an unknown
is unknown, and `and`/`or`/`not` follow Kleene's logic (docs/routes.md)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from dgstream.schemas import ClassificationResult, SkippedAnswer
from dgstream.schemas.kinds import get_kind
from dgstream.workers.routes.fields import Value
from dgstream.workers.routes.tree import And, Bool, FieldRef, Node, Not, Num, Or, Text


def field_value(result: ClassificationResult, ref: FieldRef) -> Value:
    answer = result.answers.get(ref.question)
    if answer is None:
        return None
    if ref.name == "skipped":
        return isinstance(answer, SkippedAnswer)
    if isinstance(answer, SkippedAnswer):
        return None
    diag = result.diagnostics
    if ref.name == "entropy":
        return diag.entropy.get(ref.question)
    if ref.name == "label_mass":
        return diag.label_mass.get(ref.question)
    return _answer_value(answer, ref.name)


def _answer_value(answer: Any, name: str) -> Value:
    if name in ("confidence", "stderr", "agreement"):
        value: Value = getattr(answer, name)
        return value
    kind = get_kind(answer.type)
    if name == "label":
        return kind.answer_name(answer)
    # A field of another kind has no value here (the load-time checks refuse it where the
    # pipeline's questions are known).
    own: Value = kind.value(answer, name) if name in kind.fields else None
    return own


_COMPARE: Mapping[str, Callable[[Any, Any], bool]] = {
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
}


def _all(values: Iterable[Value]) -> Value:
    """Three-valued `and`: false wins, then unknown."""
    unknown = False
    for v in values:
        if v is False:
            return False
        unknown = unknown or v is None
    return None if unknown else True


def _any(values: Iterable[Value]) -> Value:
    """Three-valued `or`: true wins, then unknown."""
    unknown = False
    for v in values:
        if v is True:
            return True
        unknown = unknown or v is None
    return None if unknown else False


def evaluate(node: Node, value_of: Callable[[FieldRef], Value]) -> Value:
    """The node's three-valued value, each field's value from `value_of` (None: unknown):
    a result's answers when routing, a trial assignment when checking (`_can_hold`)."""
    if isinstance(node, Num | Text | Bool):
        return node.value
    if isinstance(node, FieldRef):
        return value_of(node)
    if isinstance(node, Not):
        inner = evaluate(node.item, value_of)
        return None if inner is None else not inner
    if isinstance(node, And):
        return _all(evaluate(item, value_of) for item in node.items)
    if isinstance(node, Or):
        return _any(evaluate(item, value_of) for item in node.items)
    values = [evaluate(o, value_of) for o in node.operands]

    def pair(k: int) -> Value:
        a, b = values[k], values[k + 1]
        return None if a is None or b is None else _COMPARE[node.ops[k]](a, b)

    return _all(pair(k) for k in range(len(node.ops)))

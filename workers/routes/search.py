"""Whether some answer makes a whole condition true: the check behind "never true"."""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable, Mapping, Sequence

from dgstream.workers.routes.evaluate import evaluate
from dgstream.workers.routes.fields import FIELDS, QuestionInfo, RouteError, Value, field_range
from dgstream.workers.routes.tree import Bool, Compare, FieldRef, Node, Num, Text, fields_of, walk

# Whether some answer makes a whole condition true is found by trying values: each field
# takes a few representatives (the constants it is compared with, points between them and
# the ends of its range), between which no comparison changes its outcome, and the search
# assigns them one field at a time. Three-valued logic prunes it: a condition false while
# some fields are still unknown is false whatever they turn out to be. Fields are taken as
# independent (a question's p_yes and confidence too), so the search may find an answer no
# result has, never miss one: a condition that can be true is never refused. The budget,
# in evaluations of the condition: the conditions of the tests and docs need under a
# hundred; the slowest tried, a 1,200-character parity chain over 14 fields that no
# search shortcut decides, takes about a second to exhaust it (then it is not refused).
_SEARCH_BUDGET = 5_000


def _links(tree: Node) -> tuple[dict[str, set[Value]], dict[str, set[str]]]:
    """Per field: the constants it is compared with, and the fields it is compared with
    (transitively, itself included)."""
    consts: dict[str, set[Value]] = {}
    group: dict[str, set[str]] = {}
    for node in walk(tree):
        if isinstance(node, FieldRef):
            consts.setdefault(str(node), set())
            group.setdefault(str(node), {str(node)})
        if not isinstance(node, Compare):
            continue
        for a, b in zip(node.operands, node.operands[1:], strict=False):
            if isinstance(a, FieldRef) and isinstance(b, FieldRef):
                joined = group.setdefault(str(a), {str(a)}) | group.setdefault(str(b), {str(b)})
                for name in joined:
                    group[name] = joined
            for x, y in ((a, b), (b, a)):
                if isinstance(x, FieldRef) and isinstance(y, Num | Text | Bool):
                    consts.setdefault(str(x), set()).add(y.value)
    return consts, group


def _numbers(consts: Iterable[float], low: float, high: float, k: int) -> list[Value]:
    """Representatives of a number in low..high: every constant and finite end, and `k`
    points inside each gap and beyond an open end (k fields compared with one another may
    need k distinct values there)."""
    pts = sorted(
        {c for c in consts if low <= c <= high} | {e for e in (low, high) if math.isfinite(e)}
    )
    pts = pts or [0.0]
    out: list[Value] = list(pts)
    steps = [i / (k + 1) for i in range(1, k + 1)]
    out += [a + (b - a) * t for a, b in itertools.pairwise(pts) for t in steps]
    if low == -math.inf:
        out += [pts[0] - i for i in range(1, k + 1)]
    if high == math.inf:
        out += [pts[-1] + i for i in range(1, k + 1)]
    return out


def _texts(consts: set[Value], answers: set[str] | None, k: int) -> list[Value]:
    """Representatives of a text: the question's answers when known, else the constants
    and `k` texts that are none of them."""
    if answers is not None:
        return [*sorted(answers)]
    out: list[Value] = [*sorted(str(c) for c in consts)]
    fresh = (f"\x00{i}" for i in itertools.count())
    out += list(itertools.islice((t for t in fresh if t not in consts), k))
    return out


def _representatives(
    tree: Node, known: Mapping[str, Sequence[QuestionInfo]] | None
) -> dict[str, list[Value]]:
    """Every field's representatives, in the order the condition reads them."""
    consts, group = _links(tree)
    out: dict[str, list[Value]] = {}
    for r in fields_of(tree):
        name = str(r)
        if name in out:
            continue
        pooled = set().union(*(consts[g] for g in group[name]))
        k = len(group[name])
        spec = FIELDS[r.name]
        infos = known.get(r.question) if known else None
        if spec.type == "number":
            low, high = field_range(r, infos)
            out[name] = _numbers((c for c in pooled if isinstance(c, float)), low, high, k)
        elif spec.type == "text":
            answers = (
                None
                if infos is None
                else {a for i in infos if i.kind in spec.kinds for a in i.answers}
            )
            out[name] = _texts(pooled, answers, k)
        else:
            out[name] = [True, False]
    return out


def _can_hold(tree: Node, values: Mapping[str, list[Value]]) -> bool | None:
    """Whether some assignment of `values` makes the condition true; None when the search
    ran out of budget."""
    names = list(values)
    env: dict[str, Value] = {}
    left = [_SEARCH_BUDGET]

    def value_of(ref: FieldRef) -> Value:
        return env.get(str(ref))

    def search(i: int) -> bool | None:
        left[0] -= 1
        if left[0] < 0:
            return None
        now = evaluate(tree, value_of)
        if now is not None or i == len(names):
            return now is True
        for v in values[names[i]]:
            env[names[i]] = v
            found = search(i + 1)
            if found is not False:
                return found
        del env[names[i]]
        return False

    return search(0)


def check_whole(tree: Node, known: Mapping[str, Sequence[QuestionInfo]] | None) -> None:
    """RouteError("never true: ...") when no answer makes the condition true."""
    if _can_hold(tree, _representatives(tree, known)) is not False:
        return
    names = list(dict.fromkeys(str(r) for r in fields_of(tree)))
    if not names:
        raise RouteError("never true: it holds for no answer", tree.pos)
    what = f"value of {names[0]}" if len(names) == 1 else "values of " + ", ".join(names)
    raise RouteError(f"never true: no {what} makes it hold", tree.pos)

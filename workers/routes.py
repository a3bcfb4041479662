"""Routes: where each result goes, decided by conditions over its answers.

The first route whose condition holds sends a result to its topic, else it goes to the
pipeline's output topic; a request's own `reply_topic` wins over both. Conditions are a
small expression language tokenized and parsed here (never `eval`), with three-valued logic
for fields that have no value; `check_condition` finds at load time what can be known to be
wrong: a comparison the field's range decides, or a whole condition no answer makes true.
The grammar, the fields and the checks: docs/routes.md.
"""

from __future__ import annotations

import itertools
import math
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from schemas import (
    ChoiceAnswer,
    ClassificationResult,
    QuestionKind,
    ScoreAnswer,
    SkippedAnswer,
    YesNoAnswer,
)
from schemas.names import TOPIC_PATTERN, is_question_id

__all__ = [
    "DEFAULT_ROUTE",
    "FIELDS",
    "REPLY_ROUTE",
    "Condition",
    "Route",
    "RouteError",
    "RouteMatch",
    "Router",
    "check_condition",
    "check_routes",
    "parse_condition",
]

# Bounds that keep parsing and evaluation cheap and free of deep recursion; a moderation
# rule is a line or two, far below either.
MAX_CONDITION_CHARS = 2000
MAX_NESTING = 32
MAX_ROUTES = 100

DEFAULT_ROUTE = "default"  # no route matched: the pipeline's output topic
REPLY_ROUTE = "reply"  # the request named its own reply_topic

_ROUTE_NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"

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


# --------------------------------------------------------------------------- fields


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


# --------------------------------------------------------------------------- tokens


class _Tok(NamedTuple):
    kind: str  # num, str, name, op, ".", "(", ")", "-", end
    text: str
    pos: int


_TOKEN = re.compile(
    r"""(?P<ws>\s+)
      | (?P<num>(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][+-]?\d+)?)
      | (?P<name>[A-Za-z_][A-Za-z0-9_]*)
      | (?P<op><=|>=|==|!=|<|>)
      | (?P<punct>[.()\-])
      | (?P<quote>["'])""",
    re.VERBOSE,
)
_ESCAPES = {"\\": "\\", '"': '"', "'": "'", "n": "\n", "t": "\t"}


def _string(text: str, start: int) -> tuple[str, int]:
    """The string literal opening at `start`: its value and the index after it."""
    quote, i = text[start], start + 1
    out: list[str] = []
    while i < len(text):
        c = text[i]
        if c == quote:
            return "".join(out), i + 1
        if c == "\\":
            nxt = text[i + 1 : i + 2]
            if nxt not in _ESCAPES:
                raise RouteError(f"unknown escape \\{nxt} in a string", i)
            out.append(_ESCAPES[nxt])
            i += 2
            continue
        out.append(c)
        i += 1
    raise RouteError("unterminated string", start)


def tokenize(text: str) -> list[_Tok]:
    """The tokens of a condition, ending with an `end` token; RouteError on a bad one."""
    out: list[_Tok] = []
    i = 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            hint = " (compare with ==)" if text[i] == "=" else ""
            raise RouteError(f"unexpected character {text[i]!r}{hint}", i)
        kind = m.lastgroup or ""
        if kind == "quote":
            value, i = _string(text, i)
            out.append(_Tok("str", value, m.start()))
            continue
        if kind != "ws":
            tok_kind = m.group() if kind == "punct" else kind
            out.append(_Tok(tok_kind, m.group(), m.start()))
        i = m.end()
    out.append(_Tok("end", "", len(text)))
    return out


# --------------------------------------------------------------------------- the tree


@dataclass(frozen=True)
class Num:
    value: float
    pos: int


@dataclass(frozen=True)
class Text:
    value: str
    pos: int


@dataclass(frozen=True)
class Bool:
    value: bool
    pos: int


@dataclass(frozen=True)
class FieldRef:
    question: str
    name: str
    pos: int

    def __str__(self) -> str:
        return f"{self.question}.{self.name}"


@dataclass(frozen=True)
class Not:
    item: Node
    pos: int


@dataclass(frozen=True)
class And:
    items: tuple[Node, ...]
    pos: int


@dataclass(frozen=True)
class Or:
    items: tuple[Node, ...]
    pos: int


@dataclass(frozen=True)
class Compare:
    operands: tuple[Node, ...]  # n + 1 operands for n operators
    ops: tuple[str, ...]
    pos: int


Node = Num | Text | Bool | FieldRef | Not | And | Or | Compare


# --------------------------------------------------------------------------- parser


class _Parser:
    def __init__(self, tokens: list[_Tok]) -> None:
        self.toks = tokens
        self.i = 0
        self.depth = 0

    def peek(self, ahead: int = 0) -> _Tok:
        return self.toks[min(self.i + ahead, len(self.toks) - 1)]

    def take(self) -> _Tok:
        tok = self.peek()
        self.i += 1
        return tok

    def is_word(self, word: str) -> bool:
        # A keyword is a question id when a field follows it (`not.p_yes`).
        tok = self.peek()
        return tok.kind == "name" and tok.text == word and self.peek(1).kind != "."

    def nest(self, pos: int) -> None:
        self.depth += 1
        if self.depth > MAX_NESTING:
            raise RouteError(f"nested more than {MAX_NESTING} levels deep", pos)

    def condition(self) -> Node:
        node = self.or_()
        tok = self.peek()
        if tok.kind != "end":
            raise RouteError(f"unexpected {tok.text!r} after a complete condition", tok.pos)
        return node

    def or_(self) -> Node:
        pos = self.peek().pos
        items = [self.and_()]
        while self.is_word("or"):
            self.take()
            items.append(self.and_())
        return items[0] if len(items) == 1 else Or(tuple(items), pos)

    def and_(self) -> Node:
        pos = self.peek().pos
        items = [self.not_()]
        while self.is_word("and"):
            self.take()
            items.append(self.not_())
        return items[0] if len(items) == 1 else And(tuple(items), pos)

    def not_(self) -> Node:
        if self.is_word("not"):
            pos = self.take().pos
            self.nest(pos)
            item = self.not_()
            self.depth -= 1
            return Not(item, pos)
        return self.comparison()

    def comparison(self) -> Node:
        pos = self.peek().pos
        operands, ops = [self.operand()], []
        while self.peek().kind == "op":
            ops.append(self.take().text)
            operands.append(self.operand())
        return operands[0] if not ops else Compare(tuple(operands), tuple(ops), pos)

    def operand(self) -> Node:
        tok = self.take()
        if tok.kind == "num" or (tok.kind == "-" and self.peek().kind == "num"):
            return self.number(tok)
        if tok.kind == "str":
            return Text(tok.text, tok.pos)
        if tok.kind == "(":
            self.nest(tok.pos)
            inner = self.or_()
            self.depth -= 1
            close = self.take()
            if close.kind != ")":
                raise RouteError(f"expected ')' to close the '(' at {tok.pos + 1}", close.pos)
            return inner
        if tok.kind == "name":
            return self.name(tok)
        what = "the end" if tok.kind == "end" else repr(tok.text)
        raise RouteError(f"expected a value or a field, got {what}", tok.pos)

    def number(self, tok: _Tok) -> Num:
        sign = 1.0
        if tok.kind == "-":
            sign, tok = -1.0, self.take()
        value = sign * float(tok.text)
        if not math.isfinite(value):
            raise RouteError(f"number {tok.text} is out of range", tok.pos)
        return Num(value, tok.pos)

    def name(self, tok: _Tok) -> Node:
        if self.peek().kind != ".":
            if tok.text in ("true", "false"):
                return Bool(tok.text == "true", tok.pos)
            raise RouteError(
                f"{tok.text!r} is not a field: write question.field (e.g. {tok.text}.p_yes)",
                tok.pos,
            )
        self.take()
        attr = self.take()
        if attr.kind != "name":
            raise RouteError(f"expected a field name after '{tok.text}.'", attr.pos)
        if not is_question_id(tok.text):
            raise RouteError(f"{tok.text!r} is not a question id", tok.pos)
        if attr.text not in FIELDS:
            raise RouteError(f"unknown field {attr.text!r}; fields: {', '.join(FIELDS)}", attr.pos)
        return FieldRef(tok.text, attr.text, tok.pos)


# --------------------------------------------------------------------------- types


_ORDERING = frozenset({"<", "<=", ">", ">="})


def _type(node: Node) -> ValueType:
    """The node's value type; RouteError where operands do not fit their operators."""
    if isinstance(node, Num):
        return "number"
    if isinstance(node, Text):
        return "text"
    if isinstance(node, FieldRef):
        return FIELDS[node.name].type
    if isinstance(node, Compare):
        _check_compare(node)
        return "bool"
    items = (node.item,) if isinstance(node, Not) else () if isinstance(node, Bool) else node.items
    for item in items:
        if _type(item) != "bool":
            raise RouteError(
                f"{_describe(item)} is a {_type(item)}, not a condition "
                "(compare it: e.g. q.p_yes >= 0.9)",
                item.pos,
            )
    return "bool"


def _check_compare(node: Compare) -> None:
    types = [_type(o) for o in node.operands]
    for k, op in enumerate(node.ops):
        left, right = types[k], types[k + 1]
        if left != right:
            raise RouteError(
                f"cannot compare {_describe(node.operands[k])} ({left}) with "
                f"{_describe(node.operands[k + 1])} ({right})",
                node.operands[k].pos,
            )
        if op in _ORDERING and left != "number":
            raise RouteError(f"{op} compares numbers; {left}s take == or !=", node.pos)
    if all(isinstance(o, Num | Text | Bool) for o in node.operands):
        raise RouteError("compares constants only: it is always true or always false", node.pos)


def _describe(node: Node) -> str:
    if isinstance(node, FieldRef):
        return str(node)
    if isinstance(node, Num):
        return f"{node.value:g}"
    if isinstance(node, Text):
        return repr(node.value)
    if isinstance(node, Bool):
        return str(node.value).lower()
    return "the expression"


# --------------------------------------------------------------------------- evaluation


def _field_value(result: ClassificationResult, ref: FieldRef) -> Value:
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


def _answer_value(answer: YesNoAnswer | ChoiceAnswer | ScoreAnswer, name: str) -> Value:
    if name in ("confidence", "stderr", "agreement"):
        value: Value = getattr(answer, name)
        return value
    if isinstance(answer, YesNoAnswer):
        return {"p_yes": answer.p_yes, "label": answer.label}.get(name)
    if isinstance(answer, ChoiceAnswer):
        return answer.choice if name in ("choice", "label") else None
    if name == "expected_score":
        return answer.expected_score
    if name == "score":
        return answer.expected_score - 1.0
    return answer.level if name in ("level", "label") else None


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


def _evaluate(node: Node, value_of: Callable[[FieldRef], Value]) -> Value:
    """The node's three-valued value, each field's value from `value_of` (None: unknown):
    a result's answers when routing, a trial assignment when checking (`_can_hold`)."""
    if isinstance(node, Num | Text | Bool):
        return node.value
    if isinstance(node, FieldRef):
        return value_of(node)
    if isinstance(node, Not):
        inner = _evaluate(node.item, value_of)
        return None if inner is None else not inner
    if isinstance(node, And):
        return _all(_evaluate(item, value_of) for item in node.items)
    if isinstance(node, Or):
        return _any(_evaluate(item, value_of) for item in node.items)
    values = [_evaluate(o, value_of) for o in node.operands]

    def pair(k: int) -> Value:
        a, b = values[k], values[k + 1]
        return None if a is None or b is None else _COMPARE[node.ops[k]](a, b)

    return _all(pair(k) for k in range(len(node.ops)))


@dataclass(frozen=True)
class Condition:
    """A parsed, type-checked condition."""

    text: str
    tree: Node

    def evaluate(self, result: ClassificationResult) -> bool:
        """Whether the condition holds for `result` (unknown counts as not holding)."""
        return _evaluate(self.tree, lambda ref: _field_value(result, ref)) is True

    def fields(self) -> list[FieldRef]:
        """Every field the condition reads, in order."""
        return _fields(self.tree)


def _fields(tree: Node) -> list[FieldRef]:
    out: list[FieldRef] = []
    stack: list[Node] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, FieldRef):
            out.append(node)
        elif isinstance(node, Not):
            stack.append(node.item)
        elif isinstance(node, And | Or):
            stack.extend(reversed(node.items))
        elif isinstance(node, Compare):
            stack.extend(reversed(node.operands))
    return out


def parse_condition(text: str) -> Condition:
    """Parse and type-check a condition. Raises RouteError (never anything else)."""
    if not isinstance(text, str):
        raise RouteError(f"a condition is text, not {type(text).__name__}")
    if len(text) > MAX_CONDITION_CHARS:
        raise RouteError(f"the condition has {len(text)} characters; at most {MAX_CONDITION_CHARS}")
    if not text.strip():
        raise RouteError("the condition is empty")
    tree = _Parser(tokenize(text)).condition()
    if _type(tree) != "bool":
        raise RouteError(
            f"{_describe(tree)} is a {_type(tree)}, not a condition (compare it: e.g. "
            "q.p_yes >= 0.9)",
            tree.pos,
        )
    return Condition(text, tree)


# --------------------------------------------------------------------------- load-time checks


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


def _field_range(ref: FieldRef, infos: Sequence[QuestionInfo] | None) -> tuple[float, float]:
    spec = FIELDS[ref.name]
    sizes = [len(i.answers) for i in infos or () if i.kind == "score"]
    if ref.name == "score" and sizes:
        return 0.0, max(sizes) - 1.0
    if ref.name == "expected_score" and sizes:
        return 1.0, float(max(sizes))
    return spec.low, spec.high


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


# --------------------------------------------------------------------------- whole conditions

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
    for node in _walk(tree):
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
    for r in _fields(tree):
        name = str(r)
        if name in out:
            continue
        pooled = set().union(*(consts[g] for g in group[name]))
        k = len(group[name])
        spec = FIELDS[r.name]
        infos = known.get(r.question) if known else None
        if spec.type == "number":
            low, high = _field_range(r, infos)
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
        now = _evaluate(tree, value_of)
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


def _check_whole(condition: Condition, known: Mapping[str, Sequence[QuestionInfo]] | None) -> None:
    tree = condition.tree
    if _can_hold(tree, _representatives(tree, known)) is not False:
        return
    names = list(dict.fromkeys(str(r) for r in condition.fields()))
    if not names:
        raise RouteError("never true: it holds for no answer", tree.pos)
    what = f"value of {names[0]}" if len(names) == 1 else "values of " + ", ".join(names)
    raise RouteError(f"never true: no {what} makes it hold", tree.pos)


def _walk(node: Node) -> Iterable[Node]:
    stack = [node]
    while stack:
        n = stack.pop()
        yield n
        if isinstance(n, Not):
            stack.append(n.item)
        elif isinstance(n, And | Or):
            stack.extend(n.items)
        elif isinstance(n, Compare):
            stack.extend(n.operands)


def check_condition(
    condition: Condition, known: Mapping[str, Sequence[QuestionInfo]] | None = None
) -> None:
    """The load-time checks (module docstring). `known`: the pipeline's questions by id
    (`question_info`), or None when its questions are not known (inline questions)."""
    refs = condition.fields()
    for ref in refs:
        _check_field(ref, known)
    ranges = {str(r): _field_range(r, known.get(r.question) if known else None) for r in refs}
    for node in _walk(condition.tree):
        if isinstance(node, Compare):
            _check_bounds(node, ranges)
            _check_texts(node, known)
    _check_whole(condition, known)


def _check_texts(node: Compare, known: Mapping[str, Sequence[QuestionInfo]] | None) -> None:
    if known is None:
        return
    for k, op in enumerate(node.ops):
        a, b = node.operands[k], node.operands[k + 1]
        if isinstance(a, Text) and isinstance(b, FieldRef):
            a, b = b, a
        if isinstance(a, FieldRef) and isinstance(b, Text):
            _check_text(a, b, op, known[a.question])


# --------------------------------------------------------------------------- routes


class Route(BaseModel):
    """One route: results for which `when` holds go to `topic`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Names the route in metrics and errors: lower case, digits, "-" and "_"; not "default"
    # or "reply" (the results no route takes, and those for a request's reply topic).
    name: str = Field(pattern=_ROUTE_NAME)
    # The condition over the answers, e.g. `0.4 <= toxic.p_yes < 0.9` (docs/routes.md).
    when: str
    # Where the results for which `when` holds go.
    topic: str = Field(pattern=TOPIC_PATTERN)
    _condition: Condition | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _parse(self) -> Route:
        if self.name in (DEFAULT_ROUTE, REPLY_ROUTE):
            raise ValueError(f"route {self.name!r}: the name is reserved")
        try:
            self._condition = parse_condition(self.when)
        except RouteError as exc:
            raise ValueError(f"route {self.name!r}: when: {exc}") from None
        return self

    @property
    def condition(self) -> Condition:
        assert self._condition is not None
        return self._condition


def check_routes(
    routes: Sequence[Route],
    question_sets: Sequence[Mapping[str, Any]] | None,
    *,
    forbidden_topics: Iterable[str] = (),
) -> None:
    """All load-time checks of a pipeline's routes; ValueError naming the route.

    `question_sets`: the pipeline's question sets (each id -> question), or None when it
    has none (its requests bring their own questions, whose ids cannot be known here)."""
    if len(routes) > MAX_ROUTES:
        raise ValueError(f"{len(routes)} routes; at most {MAX_ROUTES}")
    names = [r.name for r in routes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"route names must be unique: {dup}")
    known = None if question_sets is None else question_info(*question_sets)
    forbidden = set(forbidden_topics)
    for i, route in enumerate(routes):
        where = f"routes[{i}] ({route.name})"
        if route.topic in forbidden:
            raise ValueError(f"{where}: topic {route.topic!r} is an input or dead-letter topic")
        try:
            check_condition(route.condition, known)
        except RouteError as exc:
            raise ValueError(f"{where}: when: {exc}") from None


class RouteMatch(NamedTuple):
    name: str
    topic: str


class Router:
    """Picks each result's topic: the request's reply topic, else the first route whose
    condition holds, else the default topic."""

    def __init__(self, routes: Sequence[Route], default_topic: str) -> None:
        self.routes = tuple(routes)
        self.default = RouteMatch(DEFAULT_ROUTE, default_topic)

    def route(self, result: ClassificationResult, reply_topic: str | None = None) -> RouteMatch:
        if reply_topic is not None:
            return RouteMatch(REPLY_ROUTE, reply_topic)
        for r in self.routes:
            if r.condition.evaluate(result):
                return RouteMatch(r.name, r.topic)
        return self.default

    @property
    def topics(self) -> list[str]:
        """Every topic a result may be routed to (the default first), without repeats."""
        return list(dict.fromkeys([self.default.topic, *(r.topic for r in self.routes)]))

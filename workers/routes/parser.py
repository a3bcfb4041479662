"""The parser (recursive descent over the lexer's tokens, never `eval`) and the type check:
a condition is parsed once, when its route is made."""

from __future__ import annotations

import math
from dataclasses import dataclass

from dgstream.schemas import ClassificationResult
from dgstream.schemas.names import is_question_id
from dgstream.workers.routes.evaluate import evaluate, field_value
from dgstream.workers.routes.fields import FIELDS, RouteError, ValueType
from dgstream.workers.routes.lexer import Token, tokenize
from dgstream.workers.routes.tree import (
    And,
    Bool,
    Compare,
    FieldRef,
    Node,
    Not,
    Num,
    Or,
    Text,
    describe,
    fields_of,
)

# Bounds that keep parsing and evaluation cheap and free of deep recursion; a moderation
# rule is a line or two, far below either.
MAX_CONDITION_CHARS = 2000
MAX_NESTING = 32


class _Parser:
    def __init__(self, tokens: list[Token]) -> None:
        self.toks = tokens
        self.i = 0
        self.depth = 0

    def peek(self, ahead: int = 0) -> Token:
        return self.toks[min(self.i + ahead, len(self.toks) - 1)]

    def take(self) -> Token:
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

    def number(self, tok: Token) -> Num:
        sign = 1.0
        if tok.kind == "-":
            sign, tok = -1.0, self.take()
        value = sign * float(tok.text)
        if not math.isfinite(value):
            raise RouteError(f"number {tok.text} is out of range", tok.pos)
        return Num(value, tok.pos)

    def name(self, tok: Token) -> Node:
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
                f"{describe(item)} is a {_type(item)}, not a condition "
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
                f"cannot compare {describe(node.operands[k])} ({left}) with "
                f"{describe(node.operands[k + 1])} ({right})",
                node.operands[k].pos,
            )
        if op in _ORDERING and left != "number":
            raise RouteError(f"{op} compares numbers; {left}s take == or !=", node.pos)
    if all(isinstance(o, Num | Text | Bool) for o in node.operands):
        raise RouteError("compares constants only: it is always true or always false", node.pos)


@dataclass(frozen=True)
class Condition:
    """A parsed, type-checked condition."""

    text: str
    tree: Node

    def evaluate(self, result: ClassificationResult) -> bool:
        """Whether the condition holds for `result` (unknown counts as not holding)."""
        return evaluate(self.tree, lambda ref: field_value(result, ref)) is True

    def fields(self) -> list[FieldRef]:
        """Every field the condition reads, in order."""
        return fields_of(self.tree)


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
            f"{describe(tree)} is a {_type(tree)}, not a condition (compare it: e.g. "
            "q.p_yes >= 0.9)",
            tree.pos,
        )
    return Condition(text, tree)

"""The parsed condition: its node types, and walks over them."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


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


def fields_of(tree: Node) -> list[FieldRef]:
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


def walk(node: Node) -> Iterable[Node]:
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


def describe(node: Node) -> str:
    if isinstance(node, FieldRef):
        return str(node)
    if isinstance(node, Num):
        return f"{node.value:g}"
    if isinstance(node, Text):
        return repr(node.value)
    if isinstance(node, Bool):
        return str(node.value).lower()
    return "the expression"

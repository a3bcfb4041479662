"""The tokens of a condition: numbers, quoted texts, names, operators and punctuation."""

from __future__ import annotations

import re
from typing import NamedTuple

from dgstream.workers.routes.fields import RouteError


class Token(NamedTuple):
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


def tokenize(text: str) -> list[Token]:
    """The tokens of a condition, ending with an `end` token; RouteError on a bad one."""
    out: list[Token] = []
    i = 0
    while i < len(text):
        m = _TOKEN.match(text, i)
        if m is None:
            hint = " (compare with ==)" if text[i] == "=" else ""
            raise RouteError(f"unexpected character {text[i]!r}{hint}", i)
        kind = m.lastgroup or ""
        if kind == "quote":
            value, i = _string(text, i)
            out.append(Token("str", value, m.start()))
            continue
        if kind != "ws":
            tok_kind = m.group() if kind == "punct" else kind
            out.append(Token(tok_kind, m.group(), m.start()))
        i = m.end()
    out.append(Token("end", "", len(text)))
    return out

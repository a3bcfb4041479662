"""Figures quoted outside docs/benchmarks.md come from it: each is defined once, where a
benchmark's rendered section shows it, and every quote is filled from there.

In docs/benchmarks.md, inside a section (`<!-- NAME:start -->` ... `<!-- NAME:end -->`),
a figure is marked where it stands:

    <!-- figure: KEY -->0.99<!-- /figure -->

and anywhere else (README.md, docs/*.md) it is quoted as `NAME/KEY`:

    <!-- figure: NAME/KEY -->0.99<!-- /figure -->

(HTML comments: a rendered page shows the value alone.) `fill()` copies each definition's
value into its quotes; `problems()` lists the quotes that differ from their definition or
name none, and the definitions named twice. `bench/report.write_section` fills the quotes
after it writes a section, so a benchmark run updates both; `figure(KEY, value)` is how a
renderer marks one. By hand: `python -m bench.harness.figures [--check]`.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "docs" / "benchmarks.md"

_SECTION = re.compile(r"<!-- ([a-z0-9-]+):start -->(.*?)<!-- \1:end -->", re.S)
# The value between the markers is plain text, without markup or code ('<' or a backtick
# ends it: a page may show the markers themselves in code).
_FIGURE = re.compile(r"<!-- figure: ([A-Za-z0-9_./-]+) -->([^<`]*)<!-- /figure -->")


def figure(key: str, value: object) -> str:
    """A figure's definition, for a renderer: `value` as text, marked as `key`."""
    text = str(value)
    if "<" in text or "`" in text or "/" in key:
        raise ValueError(f"a figure's key has no '/', its value no '<' or '`': {key!r}, {text!r}")
    return f"<!-- figure: {key} -->{text}<!-- /figure -->"


def definitions(source: str | None = None) -> tuple[dict[str, str], list[str]]:
    """ "NAME/KEY" -> value for every figure of docs/benchmarks.md's sections, and the
    keys defined more than once."""
    text = SOURCE.read_text() if source is None else source
    out: dict[str, str] = {}
    twice: list[str] = []
    for section in _SECTION.finditer(text):
        for m in _FIGURE.finditer(section.group(2)):
            key = f"{section.group(1)}/{m.group(1)}"
            if key in out:
                twice.append(key)
            out[key] = m.group(2)
    return out, twice


def quoting_files(root: Path = ROOT) -> list[Path]:
    """The pages that may quote figures: the README and every page of docs/ but the source."""
    source = root / "docs" / "benchmarks.md"
    return [root / "README.md", *sorted(p for p in (root / "docs").glob("*.md") if p != source)]


def _quotes(text: str) -> list[re.Match[str]]:
    return [m for m in _FIGURE.finditer(text) if "/" in m.group(1)]


def filled(text: str, defs: dict[str, str]) -> str:
    """`text` with every quote's value replaced by its definition's (unknown ones kept)."""

    def one(m: re.Match[str]) -> str:
        key = m.group(1)
        if "/" not in key or key not in defs:
            return m.group(0)
        return f"<!-- figure: {key} -->{defs[key]}<!-- /figure -->"

    return _FIGURE.sub(one, text)


def fill() -> list[Path]:
    """Rewrite the quotes of every quoting page from docs/benchmarks.md; the pages changed."""
    defs, _ = definitions()
    changed = []
    for path in quoting_files():
        text = path.read_text()
        new = filled(text, defs)
        if new != text:
            path.write_text(new)
            changed.append(path)
    return changed


def problems(root: Path = ROOT) -> list[str]:
    """What is wrong, one line each: quotes that differ or name no figure, keys defined
    twice, figures marked in docs/benchmarks.md outside any section."""
    source = (root / "docs" / "benchmarks.md").read_text()
    defs, twice = definitions(source)
    out = [f"docs/benchmarks.md: figure {k} is defined more than once" for k in twice]
    inside = sum(len(_FIGURE.findall(s.group(2))) for s in _SECTION.finditer(source))
    if inside != len(_FIGURE.findall(source)):
        out.append("docs/benchmarks.md: a figure is marked outside a rendered section")
    for path in quoting_files(root):
        text = path.read_text()
        rel = path.relative_to(root)
        for m in _quotes(text):
            line = text.count("\n", 0, m.start()) + 1
            key, value = m.group(1), m.group(2)
            if key not in defs:
                out.append(f"{rel}:{line}: figure {key} is not in docs/benchmarks.md")
            elif value != defs[key]:
                out.append(
                    f"{rel}:{line}: figure {key} is {value!r}, docs/benchmarks.md has "
                    f"{defs[key]!r} (python -m bench.harness.figures fills it)"
                )
        for m in _FIGURE.finditer(text):
            if "/" not in m.group(1):
                line = text.count("\n", 0, m.start()) + 1
                out.append(
                    f"{rel}:{line}: figure {m.group(1)} is defined outside "
                    "docs/benchmarks.md (quote one as SECTION/KEY)"
                )
    return out


def main(argv: list[str]) -> int:
    if "--check" in argv:
        found = problems()
        print("\n".join(found) or "every quoted figure matches docs/benchmarks.md")
        return 1 if found else 0
    for path in fill():
        print(f"filled {path.relative_to(ROOT)}")
    found = problems()
    if found:
        print("\n".join(found), file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""Keeps docs/benchmarks.md: each benchmark owns one section between markers and rewrites
only that section, so figures from different runs (CPU here, GPU there) live side by side.
A section marks the figures other pages quote (`figure(key, value)`); writing a section
fills those quotes (bench/harness/figures.py), so the README follows the run. A dated
section moved to docs/history/ is rewritten where it now is."""

from __future__ import annotations

import re
from pathlib import Path

from bench.harness.figures import figure, fill

__all__ = ["DOC", "HISTORY", "figure", "home", "write_section"]

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"
# Dated lab notes; a section moved there is rewritten there (`home`).
HISTORY = DOC.parent / "history"

HEADER = """# Benchmarks

Every figure below was measured by the command shown with it; rerun the command to
reproduce it. Ratios compare variants measured side by side in one run; absolute times
come only from the GPU machine (one NVIDIA H200).
"""


def home(name: str, doc: Path = DOC) -> Path:
    """The page that holds section `name`: `doc`, unless `doc` is docs/benchmarks.md, lacks
    the section, and a page of docs/history/ has it (a dated run moved to the lab notes)."""
    start = f"<!-- {name}:start -->"
    if doc != DOC or (doc.exists() and start in doc.read_text()):
        return doc
    for page in sorted(HISTORY.glob("*.md")):
        if start in page.read_text():
            return page
    return doc


def write_section(name: str, markdown: str, doc: Path = DOC) -> None:
    doc = home(name, doc)
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{markdown.strip()}\n{end}"
    text = doc.read_text() if doc.exists() else HEADER
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else f"{text.rstrip()}\n\n{block}\n"
    )
    doc.parent.mkdir(parents=True, exist_ok=True)
    doc.write_text(text)
    if doc == DOC:
        for page in fill():
            print(f"filled the figures {page.name} quotes from {doc.name}")

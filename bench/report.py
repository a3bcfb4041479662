"""Keeps docs/benchmarks.md: each benchmark owns one section between markers and rewrites
only that section, so figures from different runs (CPU here, GPU there) live side by side.
A section marks the figures other pages quote (`figure(key, value)`); writing a section
fills those quotes (tests/support/figures.py), so the README follows the run."""

from __future__ import annotations

import re
from pathlib import Path

from bench import use_test_support

use_test_support()

from support.figures import figure, fill  # noqa: E402

__all__ = ["DOC", "figure", "write_section"]

DOC = Path(__file__).resolve().parents[1] / "docs" / "benchmarks.md"

HEADER = """# Benchmarks

Every figure below was measured by the command shown with it; rerun the command to
reproduce it. Ratios compare variants measured side by side in one run; absolute times
come only from the GPU machine (one NVIDIA H200).
"""


def write_section(name: str, markdown: str, doc: Path = DOC) -> None:
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

"""Keeps docs/benchmarks.md: each benchmark owns one section between markers and rewrites
only that section, so figures from different runs (CPU here, GPU there) live side by side."""

from __future__ import annotations

import re
from pathlib import Path

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

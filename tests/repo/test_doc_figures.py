"""The GPU figures other pages quote come from docs/benchmarks.md's rendered sections
(bench/harness/figures.py): every quote holds its definition's value, and the check sees
a quote that drifted, one that names no figure, and a key defined twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.harness.figures import definitions, figure, filled, problems

pytestmark = pytest.mark.unit

SOURCE = """# Benchmarks
<!-- run-a:start -->
ratio **<!-- figure: ratio -->0.99<!-- /figure -->**, peak <!-- figure: peak -->23.7<!-- /figure -->
<!-- run-a:end -->
"""


def test_every_quoted_figure_matches_docs_benchmarks() -> None:
    assert problems() == []
    defs, twice = definitions()
    assert twice == [] and defs, "docs/benchmarks.md defines no figure"


def q(key: str, value: str) -> str:
    return f"<!-- figure: {key} -->{value}<!-- /figure -->"


def test_quotes_are_filled_from_their_section_and_drift_is_seen(tmp_path: Path) -> None:
    defs, twice = definitions(SOURCE)
    assert defs == {"run-a/ratio": "0.99", "run-a/peak": "23.7"} and twice == []
    page = f"at {q('run-a/ratio', '1.9')}x, {q('run-b/x', '1')}"
    assert filled(page, defs) == f"at {q('run-a/ratio', '0.99')}x, {q('run-b/x', '1')}"
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "benchmarks.md").write_text(
        SOURCE.replace("<!-- run-a:end -->", f"{q('peak', '1')}\n<!-- run-a:end -->")
    )
    (tmp_path / "README.md").write_text(page)
    (tmp_path / "docs" / "x.md").write_text(f"{q('local', '3')} {q('run-a/peak', '23.7')}")
    found = problems(tmp_path)
    assert [line.split(": figure ")[1].split(" ")[0] for line in found] == [
        "run-a/peak",  # defined twice
        "run-a/ratio",  # 1.9 where the section says 0.99
        "run-b/x",  # no such section
        "run-a/peak",  # the second definition is the one that counts (and is reported)
        "local",  # a definition outside docs/benchmarks.md
    ], found


def test_a_renderer_marks_a_figure() -> None:
    assert figure("ratio", 0.99) == "<!-- figure: ratio -->0.99<!-- /figure -->"
    with pytest.raises(ValueError):
        figure("a/b", 1)

"""No comment or docstring in the repository's code points at a file outside it (the design
notes the team started from, an issue tracker): what a reader needs is in the code or under
docs/ (docs/model.md holds the outside facts the engine's defaults rest on)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("schemas", "workers", "topology", "dgstream", "infra", "bench", "tests")
_OUTSIDE = re.compile(r"DESIGN\.md|shared/|\bissue #\d|\(issue\b|\bthe issue\b", re.IGNORECASE)


def test_no_reference_points_outside_the_repository() -> None:
    found = []
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path == Path(__file__).resolve():
                continue
            for n, line in enumerate(path.read_text().splitlines(), 1):
                if _OUTSIDE.search(line):
                    found.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert found == []

"""docs/errors.md has one row for every ErrorCode, and no code that does not exist."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from dgstream.schemas import ErrorCode

pytestmark = pytest.mark.unit

DOC = Path(__file__).resolve().parents[2] / "docs" / "errors.md"


def test_every_error_code_has_one_row() -> None:
    rows = [ln for ln in DOC.read_text(encoding="utf-8").splitlines() if ln.startswith("| `")]
    named = [c for row in rows for c in re.findall(r"`([A-Z0-9_]+)`", row.split(" | ")[0])]
    assert sorted(named) == sorted(c.value for c in ErrorCode)

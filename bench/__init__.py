"""Benchmarks: scripts that print figures and write them to docs/benchmarks.md.

A script run as a file (`python bench/x.py`) first puts the repository on the import path
itself; those that drive the test harness then call `use_test_support()`.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def use_test_support() -> None:
    """Make the test support importable: tests/ (support/, waiting, faults) and tests/workers/
    (the worker tests' helpers that support/ uses)."""
    for path in (ROOT / "tests", ROOT / "tests" / "workers"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))

"""Benchmarks: scripts that print figures and write them to docs/benchmarks.md (`bench/*.py`),
and their harnesses as library code (`bench/harness/`), which the tests import too.

A script runs as a file from the repository root (`python bench/x.py`): its first lines put
the repository on the import path (the root, never tests/), then it imports `bench.harness`
and the product as packages; `python -m bench.x` works as well. tests/repo/test_layers.py
holds the rule: bench/ imports nothing of tests/.

`use_test_support()` is for what still reaches tests/support/ until it moves here: bench/gpu/
and bench/engine_vllm.py's full-size model directory (tests/support/full_size.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def use_test_support() -> None:
    """Make the test support importable: tests/ (support/) and tests/workers/ (the worker
    tests' helpers). Only bench/gpu/ and the exceptions tests/repo/test_layers.py lists."""
    for path in (ROOT / "tests", ROOT / "tests" / "workers"):
        if str(path) not in sys.path:
            sys.path.insert(0, str(path))

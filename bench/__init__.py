"""Benchmarks: scripts that print figures and write them to docs/benchmarks.md (`bench/*.py`),
and their harnesses as library code (`bench/harness/`), which the tests import too; and the
demo model's training (`bench/training/`, library code as well; `bench/train_demo_model.py`
is its command). None of it ships: the wheel holds the product's packages only.

A script runs as a file from the repository root (`python bench/x.py`): its first lines put
the repository on the import path (the root, never tests/), then it imports `bench.harness`
and the product as packages; `python -m bench.x` works as well. tests/repo/test_layers.py
holds the rule: bench/ imports nothing of tests/.
"""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

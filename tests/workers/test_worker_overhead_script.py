"""bench/worker_overhead.py, run as a script from the checkout (as `make bench` runs it)
against the real broker: it prints the side-by-side rates and leaves docs/benchmarks.md
alone unless told. A checkout's benchmark: the `dgstream` command has none (an installed
wheel holds neither bench/ nor the docs it writes)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.harness.pipeline import Pipeline

pytestmark = [pytest.mark.broker, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def test_the_worker_overhead_benchmark_runs_and_writes_only_when_told(pipeline: Pipeline) -> None:
    boot = ",".join(pipeline.conn.bootstrap_servers)
    doc = ROOT / "docs" / "benchmarks.md"
    before = doc.read_bytes()
    args = ["--bootstrap", boot, "--messages", "600", "--repeat", "1", "--no-write"]
    out = subprocess.run(
        [sys.executable, "bench/worker_overhead.py", *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "stream worker" in out.stdout and "plain" in out.stdout
    assert doc.read_bytes() == before

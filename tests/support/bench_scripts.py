"""A benchmark script run as a user runs it: a process of its own from the checkout's root,
the checkout on PYTHONPATH; a non-zero exit fails the test with the end of its output."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def run_bench(*argv: str, timeout_s: float = 600) -> str:
    """`python ARGV...` (a script's path or `-m module`) from the root; its stdout."""
    out = subprocess.run(
        [sys.executable, *argv],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    return out.stdout

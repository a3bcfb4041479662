"""Running the `dgstream` command as a subprocess, as a user would (shared by every tier)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_cli(
    *args: str,
    stdin: str | None = None,
    env: dict[str, str] | None = None,
    timeout: float = 120,
) -> subprocess.CompletedProcess[str]:
    """`python -m dgstream.topology.cli ARGS` from the repository root with this environment (plus
    `env`); never raises on a non-zero exit: the caller checks `returncode`."""
    return subprocess.run(
        [sys.executable, "-m", "dgstream.topology.cli", *args],
        input=stdin,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )

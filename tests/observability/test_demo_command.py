"""`dgstream demo --events N` end to end as a subprocess: it answers N events, dead-letters
the malformed one, exits 0 and leaves no broker or Ray process behind."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytestmark = [pytest.mark.ray, pytest.mark.broker, pytest.mark.model, pytest.mark.slow]


def _demo_processes() -> set[str]:
    """Processes of any demo on this machine (its broker and Ray live in folders named so)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return {ln.split()[0] for ln in out.splitlines() if "dgdemo-" in ln or "dgstream-demo-" in ln}


def test_demo_answers_and_cleans_up() -> None:
    # The demo gives up by itself (400 s) before this test's timeout, so a stuck pool
    # still ends with the pool's state and the workers' logs in its output, and cleans up.
    before = _demo_processes()  # another demo may be running: only ours must be gone
    proc = subprocess.run(
        [sys.executable, "-m", "topology.cli", "demo", "--events", "6", "--timeout", "400"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "6 answered, 1 dead-lettered" in proc.stdout
    assert "dead letter: WRONG_TYPE" in proc.stdout
    assert "Ray dashboard: http://127.0.0.1:" in proc.stdout
    assert "stopped everything" in proc.stdout
    assert not (_demo_processes() - before)


def test_demo_gives_up_after_its_timeout_and_cleans_up() -> None:
    """With a timeout too short for any answer, the demo says it gave up, exits 1, and
    still stops everything it started."""
    before = _demo_processes()
    proc = subprocess.run(
        [sys.executable, "-m", "topology.cli", "demo", "--events", "6", "--timeout", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "gave up after 1s" in proc.stdout
    assert "stopped everything" in proc.stdout
    assert not (_demo_processes() - before)

"""`dgstream demo --events N` end to end as a subprocess: it answers N events, dead-letters
the malformed one, exits 0 and leaves no broker or Ray process behind."""

from __future__ import annotations

import subprocess

import pytest
from cli_runner import run_cli

pytestmark = [pytest.mark.ray, pytest.mark.broker, pytest.mark.model, pytest.mark.slow]


def _demo_processes() -> set[str]:
    """Processes of any demo on this machine (its broker and Ray live in folders named so)."""
    out = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
    return {ln.split()[0] for ln in out.splitlines() if "dgdemo-" in ln or "dgstream-demo-" in ln}


def _demo(give_up_s: int, expect_rc: int) -> str:
    """Run `dgstream demo --events 6 --timeout give_up_s`; check its exit status, that it
    stopped everything and that none of its processes are left; returns its output."""
    before = _demo_processes()  # another demo may be running: only ours must be gone
    # The demo gives up by itself before this test's timeout, so a stuck pool still ends
    # with the pool's state and the workers' logs in its output, and cleans up.
    proc = run_cli("demo", "--events", "6", "--timeout", str(give_up_s), timeout=give_up_s + 200)
    assert proc.returncode == expect_rc, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stopped everything" in proc.stdout
    assert not (_demo_processes() - before)
    return proc.stdout


def test_demo_answers_and_cleans_up() -> None:
    out = _demo(400, 0)
    assert "6 answered, 1 dead-lettered" in out
    assert "dead letter: WRONG_TYPE" in out
    assert "Ray dashboard: http://127.0.0.1:" in out


def test_demo_gives_up_after_its_timeout_and_cleans_up() -> None:
    """With a timeout too short for any answer, the demo says it gave up and exits 1."""
    assert "gave up after 1s" in _demo(1, 1)

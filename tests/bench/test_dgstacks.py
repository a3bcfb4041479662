"""The host-side sampler of GPU runs (bench/gpu/card/dgstacks.py), on the CPU: it reaches a
spawned child through sitecustomize (as vLLM's engine core is spawned), samples only while
the row flag exists, and its report puts the busy function on top of the busy thread."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "bench" / "gpu" / "card"

CHILD = """
import multiprocessing as mp, sys, time
from pathlib import Path

def spin_in_the_child(flag, seconds):
    Path(flag).write_text("busy_row")
    end = time.monotonic() + seconds
    x = 0
    while time.monotonic() < end:
        x += 1
    Path(flag).unlink()
    after_the_row()

def after_the_row():  # work that no label may count
    end = time.monotonic() + 0.3
    while time.monotonic() < end:
        pass

if __name__ == "__main__":
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=spin_in_the_child, args=(sys.argv[1], 0.6))
    p.start(); p.join()
    sys.exit(p.exitcode)
"""


@pytest.mark.unit
def test_samples_a_spawned_child_only_while_the_row_is_on(tmp_path: Path) -> None:
    out = tmp_path / "stacks"
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {
        **os.environ,
        "PYTHONPATH": f"{CARD}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
        "DGSTREAM_STACKS": str(out),
    }
    env.pop("DGSTREAM_CARD_GIB", None)  # the sampler alone: no torch, no card
    run = subprocess.run(
        [sys.executable, str(script), str(out / "row")], env=env, capture_output=True, timeout=60
    )
    assert run.returncode == 0, run.stderr.decode()
    files = list(out.glob("stacks-*.json"))
    assert files, "no process wrote its samples"
    rows = [json.loads(f.read_text()) for f in files]
    # Every process samples while the flag exists (vLLM's front end and engine core both),
    # under the flag's one label, never the sampler's own thread, never after the row.
    assert all(set(r) == {"busy_row"} for r in rows)
    threads = [t for r in rows for t in r["busy_row"]]
    assert "dgstacks" not in threads
    every_stack = [s for r in rows for t in r["busy_row"].values() for s in t]
    assert not any("after_the_row" in s for s in every_stack)
    (child,) = [
        r["busy_row"]["MainThread"]
        for r in rows
        if any("spin_in_the_child" in s for s in r["busy_row"].get("MainThread", {}))
    ]
    assert sum(child.values()) >= 20
    from_spin = sum(n for s, n in child.items() if ":spin_in_the_child:" in s.split(";")[-1])
    assert from_spin / sum(child.values()) > 0.8

    sys.path.insert(0, str(CARD))
    try:
        import dgstacks
    finally:
        sys.path.remove(str(CARD))
    text = dgstacks.report(str(out), top=3)
    blocks = [b for b in text.split("== ") if "spin_in_the_child" in b]
    assert len(blocks) == 1
    first_self = blocks[0].split("self (innermost line):\n")[1].splitlines()[0]
    assert "child.py:spin_in_the_child" in first_self


SHORT_PYTHON = """
import sys, time
from pathlib import Path
sys.setswitchinterval(0.005)  # Python's default, whatever the interpreter was started with
import dgstacks
out = Path(sys.argv[1])
dgstacks.start(str(out))

def pure_python():  # 2 ms that never let the GIL go: under the default switch interval
    end = time.perf_counter() + 0.002
    while time.perf_counter() < end:
        pass

def releases():  # a call that lets the GIL go at once
    time.sleep(0.0005)

(out / "row").write_text("loop")
end = time.perf_counter() + 1.5
while time.perf_counter() < end:
    pure_python()
    releases()
(out / "row").unlink()
"""


@pytest.mark.unit
def test_pure_python_shorter_than_the_switch_interval_is_seen(tmp_path: Path) -> None:
    """Python work that never releases the GIL, 2 ms at a time, between calls that do:
    a sampler waiting for the GIL under Python's 5 ms switch interval sees only the calls
    (every sample lands where the loop lets the GIL go). The sampler sets its own
    interval, so the Python work (80% of the loop) draws its share of the samples."""
    out = tmp_path / "stacks"
    out.mkdir()
    script = tmp_path / "short.py"
    script.write_text(SHORT_PYTHON)
    env = {**os.environ, "PYTHONPATH": str(CARD)}
    env.pop("DGSTREAM_STACKS", None)
    run = subprocess.run(
        [sys.executable, str(script), str(out)], env=env, capture_output=True, timeout=60
    )
    assert run.returncode == 0, run.stderr.decode()
    (path,) = out.glob("stacks-*.json")
    main = json.loads(path.read_text())["loop"]["MainThread"]
    total = sum(main.values())
    python = sum(n for s, n in main.items() if ":pure_python:" in s.split(";")[-1])
    assert total >= 50
    assert python / total > 0.3, python / total


@pytest.mark.unit
def test_the_bias_bench_sets_each_phase_beside_its_truth() -> None:
    """bench/stacks_bias.py's loop (bench/harness/sampler_bias.py) from a clean checkout: a
    short run of one sampler setting gives shares of the loop that each add up to 100, and
    its section names each row."""
    from bench.harness import sampler_bias

    truth, sampled = sampler_bias.measure(0.5, "0.0001", "jitter")
    assert set(truth) == set(sampler_bias.PHASES)
    assert abs(sum(truth.values()) - 100) < 1e-6
    assert all(v > 0 for v in truth.values())
    assert sampled["samples"] >= 20
    assert abs(sum(sampled[p] for p in (*sampler_bias.PHASES, "other")) - 100) < 1e-6
    rows = [(name, truth, sampled) for name, _, _ in sampler_bias.SETTINGS]
    md = sampler_bias.render(rows, 0.5)
    table = [line for line in md.splitlines() if line.startswith("| ") and "sampler" not in line]
    assert [line.split(" | ")[0][2:] for line in table] == [n for n, _, _ in sampler_bias.SETTINGS]

"""The host sampler of GPU runs (bench/gpu/card/dgstacks.py) against the truth, on the CPU:
the loop, its runs under each sampler setting and docs/benchmarks.md's section. Run by
bench/stacks_bias.py; tests/bench/test_dgstacks.py runs it short.

An in-process sampler reads the frames only when it holds the GIL, so it sees a thread
where that thread lets the GIL go. The loop here has the shape of vLLM's engine core
step: pure-Python work that never releases the GIL (a scheduler), a burst of small torch
ops, each of which releases it (a runner launching kernels), and a wait with the GIL
released (waiting for the GPU). Each sampler setting runs the same loop in a child
process of its own (the switch interval is per process); the truth is the loop's own
clock around each phase.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CARD = ROOT / "bench" / "gpu" / "card"

PHASES = ("schedule", "launch", "wait")

# The engine core's step, scaled to the shares the card's profiles showed: a few ms of
# scheduling, a burst of small ops, a wait for the GPU.
CHILD = r"""
import json, sys, time
from pathlib import Path
import torch
import dgstacks

out, seconds, switch, jitter = Path(sys.argv[1]), float(sys.argv[2]), sys.argv[3], sys.argv[4]
dgstacks.start(str(out), switch_s=None if switch == "default" else float(switch),
               jitter=jitter == "jitter")
a, b = torch.zeros(64), torch.ones(64)

def schedule():  # pure Python: dicts and lists, never lets the GIL go
    t = time.perf_counter()
    while time.perf_counter() - t < 0.003:
        d = {i: [i] * 4 for i in range(50)}
        sum(len(v) for v in d.values())

def launch():  # small torch ops: each releases the GIL in its binding
    for _ in range(300):
        torch.add(a, b)

def wait():  # the GIL released throughout
    time.sleep(0.002)

truth = dict.fromkeys(("schedule", "launch", "wait"), 0.0)
(out / "row").write_text("loop")
end = time.perf_counter() + seconds
while time.perf_counter() < end:
    for phase in (schedule, launch, wait):
        t = time.perf_counter()
        phase()
        truth[phase.__name__] += time.perf_counter() - t
(out / "row").unlink()
(out / "truth.json").write_text(json.dumps(truth))
"""

# (the column's name, the switch interval, the wake-ups)
SETTINGS = [
    ("before: 5 ms switch interval, fixed period", "default", "fixed"),
    ("0.1 ms switch interval, fixed period", "0.0001", "fixed"),
    ("5 ms switch interval, jittered", "default", "jitter"),
    ("now: 0.1 ms switch interval, jittered", "0.0001", "jitter"),
    ("0.01 ms switch interval, jittered", "0.00001", "jitter"),
]


def measure(seconds: float, switch: str, jitter: str) -> tuple[dict[str, float], dict[str, float]]:
    """(truth, sampled): each phase's share of the loop's time, in %."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        script = out / "child.py"
        script.write_text(CHILD)
        env = {**os.environ, "PYTHONPATH": str(CARD)}
        env.pop("DGSTREAM_STACKS", None)  # the child starts its own sampler
        subprocess.run(
            [sys.executable, str(script), str(out), str(seconds), switch, jitter],
            env=env,
            check=True,
            timeout=seconds + 120,
        )
        truth = json.loads((out / "truth.json").read_text())
        (stacks,) = out.glob("stacks-*.json")
        main = json.loads(stacks.read_text())["loop"]["MainThread"]
    counts: Counter[str] = Counter()
    for stack, n in main.items():
        names = [frame.split(":")[1] for frame in stack.split(";")]
        phase = next((p for p in reversed(names) if p in PHASES), "other")
        counts[phase] += n
    total_t, total_n = sum(truth.values()), sum(counts.values())
    return (
        {p: 100 * truth[p] / total_t for p in PHASES},
        {p: 100 * counts[p] / total_n for p in (*PHASES, "other")} | {"samples": total_n},
    )


def render(rows: list[tuple[str, dict[str, float], dict[str, float]]], seconds: float) -> str:
    lines = [
        "## The host sampler of GPU runs against the truth (CPU)",
        "",
        "`bench/gpu/card/dgstacks.py` samples every Python thread of a GPU run from inside "
        "the process (`STACKS=1`), which needs the GIL: it sees a thread where the thread "
        "lets the GIL go. Here a loop with the shape of vLLM's engine-core step runs under "
        "each sampler setting, one child process each, for "
        f"{seconds:.0f} s: 3 ms of pure Python (`schedule`, never releasing the GIL), 300 "
        "small torch ops (`launch`, each releasing it), a 2 ms wait with the GIL released "
        "(`wait`, as for the GPU). The truth is the loop's own clock around each phase; the "
        "sampled share is the main thread's samples with that phase on the stack. "
        "Share of the loop's time, % (truth / sampled):",
        "",
        "| sampler | schedule | launch | wait | samples |",
        "|---|---:|---:|---:|---:|",
    ]
    for name, truth, sampled in rows:
        cells = [f"{truth[p]:.0f} / **{sampled[p]:.0f}**" for p in PHASES]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {sampled['samples']:.0f} |")
    now = next(sampled for name, _, sampled in rows if name.startswith("now"))
    truth_now = next(truth for name, truth, _ in rows if name.startswith("now"))
    gap = max(abs(truth_now[p] - now[p]) for p in PHASES)
    lines += [
        "",
        "Under Python's 5 ms switch interval the sampler gets the GIL only where the loop "
        "lets it go, so pure Python shorter than the interval is never seen (`schedule`) "
        "and its time lands on the next release point (the first torch op after it). A "
        "fixed period also locks onto the loop: the sampler hands the GIL back at one of "
        "the loop's release points, and a period later the loop is there again (the "
        "`wait` under-counted too). The sampler as it is now (the switch interval at 0.1 ms "
        f"while it runs, jittered wake-ups) puts each phase within {gap:.0f} points of its "
        "time. For the card's host profiles, all taken before 2026-12-05 (night) with the "
        "sampler as it was: their split between vLLM's scheduler (pure Python) and its "
        "runner (torch ops, host-to-device copies) leans to the runner, and self time on a "
        "GIL-releasing line (`async_tensor_h2d`'s copy, say) holds Python work that ran "
        "before it.",
        "",
        "Reproduce:",
        "",
        "```",
        "python bench/stacks_bias.py",
        "```",
    ]
    return "\n".join(lines)


__all__ = ["PHASES", "SETTINGS", "measure", "render"]

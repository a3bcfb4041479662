"""This checkout's stream worker against another checkout's, side by side: the ratios of
bench/worker_overhead.py (the worker against a plain loop doing the same work) and of
bench/pipelining.py (two batches in flight against one), each script run in each checkout
in turn, on one broker, in the order A B B A for every round so that a machine getting
busier or quieter over the run weighs on both alike.

Each run is the checkout's own script in a process of its own (its code on PYTHONPATH), so
the two never share a module. What each script prints is read back for its ratio.

    git worktree add /tmp/old-tree <commit>        # the checkout to compare with
    .venv/bin/python bench/side_by_side.py --other /tmp/old-tree --label-other <commit>
    .venv/bin/python bench/side_by_side.py --other /tmp/old-tree --write   # and the section
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness.rounds import PLAIN_ROW, WORKER_ROW
from bench.report import write_section
from bench.worker_overhead import broker_at

ROOT = Path(__file__).resolve().parents[1]
_PIPELINING = re.compile(r"^Ratio 2 / 1: \*\*([\d.]+)\*\*", re.M)


def run_script(tree: Path, script: str, args: list[str]) -> str:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    out = subprocess.run(
        [sys.executable, str(tree / "bench" / script), *args],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    if out.returncode != 0:
        raise RuntimeError(
            f"{tree}/bench/{script} failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}"
        )
    return out.stdout


def overhead(tree: Path, bootstrap: str, messages: int) -> tuple[float, float, float]:
    """(worker results/s, plain loop results/s, their ratio) of one run of worker_overhead."""
    text = run_script(
        tree,
        "worker_overhead.py",
        ["--bootstrap", bootstrap, "--messages", str(messages), "--no-write"],
    )
    worker, plain = WORKER_ROW.search(text), PLAIN_ROW.search(text)
    if worker is None or plain is None:
        raise RuntimeError(f"no ratio in worker_overhead's output:\n{text[-2000:]}")
    return float(worker[1].replace(",", "")), float(plain[1].replace(",", "")), float(worker[2])


def pipelining(tree: Path, bootstrap: str) -> float:
    """The 2 / 1 ratio of one run of pipelining."""
    text = run_script(tree, "pipelining.py", ["--bootstrap", bootstrap])
    found = _PIPELINING.search(text)
    if found is None:
        raise RuntimeError(f"no ratio in pipelining's output:\n{text[-2000:]}")
    return float(found[1])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--other", type=Path, required=True, help="the other checkout")
    ap.add_argument("--label-other", default="the other checkout")
    ap.add_argument("--label-this", default="this checkout")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--messages", type=int, default=20_000, help="worker_overhead's")
    ap.add_argument("--bootstrap", help="an existing broker (default: start a local one)")
    ap.add_argument("--write", action="store_true", help="rewrite docs/benchmarks.md's section")
    args = ap.parse_args(argv)
    trees = {args.label_this: ROOT, args.label_other: args.other.resolve()}
    load = os.getloadavg()[0]
    ratios: dict[str, dict[str, list[float]]] = {
        k: {"overhead": [], "pipelining": []} for k in trees
    }
    rates: dict[str, list[str]] = {k: [] for k in trees}
    with broker_at(args.bootstrap) as bootstrap:
        for r in range(args.rounds):
            order = list(trees) if r % 2 == 0 else list(trees)[::-1]
            for label in order + order[::-1]:
                worker, plain, ratio = overhead(trees[label], bootstrap, args.messages)
                ratios[label]["overhead"].append(ratio)
                rates[label].append(f"{worker:,.0f}/{plain:,.0f}")
                ratios[label]["pipelining"].append(pipelining(trees[label], bootstrap))
                print(
                    f"round {r + 1} {label}: overhead {ratio:.2f} ({worker:,.0f} / "
                    f"{plain:,.0f} results/s), pipelining {ratios[label]['pipelining'][-1]:.2f}",
                    flush=True,
                )
    md = section(args, trees, ratios, rates, load)
    print()
    print(md)
    if args.write:
        write_section("worker-side-by-side", md)
    return 0


def section(
    args: argparse.Namespace,
    trees: dict[str, Path],
    ratios: dict[str, dict[str, list[float]]],
    rates: dict[str, list[str]],
    load: float,
) -> str:
    def cell(values: list[float]) -> str:
        runs = " / ".join(f"{v:.2f}" for v in values)
        return f"**{statistics.mean(values):.2f}** ({runs})"

    runs = len(next(iter(ratios.values()))["overhead"])
    lines = [
        "## The stream worker of two checkouts, side by side",
        "",
        f"bench/worker_overhead.py ({args.messages:,} requests; the ratio of the stream worker "
        "to a plain loop doing the same work, each run the best of its own 2) and "
        "bench/pipelining.py (2,000 requests, the fake engine waiting 4 ms a read; 2 batches "
        "in flight against 1), each checkout's own scripts on one local broker, "
        f"{runs} runs of each per checkout in the order A B B A. {os.cpu_count()} CPU cores; "
        f"load average {load:.1f} at the start (the machine shared with other work: the "
        "spread of the runs is the noise).",
        "",
        "| checkout | worker / plain loop: mean (runs) | 2 in flight / 1: mean (runs) "
        "| worker / plain results/s |",
        "|---|---|---|---|",
    ]
    for label in trees:
        lines.append(
            f"| {label} | {cell(ratios[label]['overhead'])} | "
            f"{cell(ratios[label]['pipelining'])} | {', '.join(rates[label])} |"
        )
    lines += [
        "",
        f"Reproduce: `python bench/side_by_side.py --other OTHER_CHECKOUT --rounds {args.rounds}"
        + (f" --messages {args.messages}" if args.messages != 20_000 else "")
        + "` (starts and stops its own broker; `git worktree add OTHER_CHECKOUT COMMIT` makes "
        "the other checkout).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

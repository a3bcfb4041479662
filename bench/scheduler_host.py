"""The engine core scheduler's host work per read, on the CPU: vLLM 0.33's real diffusion
scheduler, its requests, KV block pool and prefix cache (SHA-256 block hashes, vLLM's
default), driven as async scheduling drives it, with the runner's output made up
(tests/support/vllm_scheduler.py). Side by side in one run: vLLM's own scheduler, the
plugin's with reads in two steps, the plugin's with one-step reads. Prints the table and
writes docs/benchmarks.md's section.

    python bench/scheduler_host.py [--batches 32,256] [--rounds 6] [--passes 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import use_test_support

use_test_support()

from support.vllm_model import write_model_dir  # noqa: E402
from support.vllm_scheduler import PROMPT, WIDTH, host_cost  # noqa: E402

MODES = ("stock", "two_step", "one_step")
# The card's best one-question-set rate at batch 256 (reads/s): an H200 as the 24 GB card,
# four batches in flight, 2026-12-04 (docs/benchmarks.md, card24-notes fix_shared_b256_x4_max).
BEST_SHARED_RATE = 977.5
LABEL = {
    "stock": "vLLM's scheduler (no plugin)",
    "two_step": "plugin, two steps",
    "one_step": "plugin, one-step reads",
}


def measure(batches: list[int], rounds: int, passes: int) -> list[dict[str, object]]:
    """Per (batch, kind, mode): the medians over `passes` passes, the modes interleaved in
    each pass so that drift in the machine's speed falls on all of them alike."""
    model = write_model_dir(Path(tempfile.mkdtemp(prefix="dgsched-")), 1000)
    rows = []
    for batch in batches:
        for kind in ("shared", "unique"):
            got: dict[str, list[dict[str, float]]] = {m: [] for m in MODES}
            for _ in range(passes):
                for mode in MODES:
                    got[mode].append(
                        host_cost(model, batch=batch, kind=kind, mode=mode, rounds=rounds)
                    )
            for mode in MODES:
                runs = got[mode]
                row: dict[str, object] = {"batch": batch, "kind": kind, "mode": mode}
                for key in ("admit", "schedule", "update", "total", "steps"):
                    row[key] = statistics.median(r[key] for r in runs)
                rows.append(row)
                print(row, flush=True)
    return rows


def render(rows: list[dict[str, object]], rounds: int, passes: int) -> str:
    stock = {(r["batch"], r["kind"]): r["total"] for r in rows if r["mode"] == "stock"}
    lines = [
        "## The scheduler's host work per read (CPU)",
        "",
        "What vLLM's engine core spends in its scheduler for each read, measured here on the "
        "CPU: vLLM 0.33's diffusion scheduler (the real class, requests, KV block pool and "
        "prefix cache with SHA-256 block hashes, vLLM's default) driven as async scheduling "
        "drives it (two steps in flight), the runner's output made up. Reads as the card "
        f"runs': {PROMPT}-token prompts, {WIDTH}-position canvases (`shared`: one prompt for "
        "the whole batch, as one question set; `unique`: each its own). `admit` is "
        "the request with its prompt's block hashes and `add_request()`, `schedule` is "
        "`schedule()`, `update` is `update_from_output()`, µs per read, medians of "
        f"{passes} interleaved passes of {rounds} batches each; `steps` is engine steps per "
        "batch. This machine's CPU (2 cores) is slower than a GPU host's: the ratios carry "
        "over, the µs are an upper bound.",
        "",
        "| batch | kind | scheduler | admit µs | schedule µs | update µs | total µs/read "
        "| steps/batch | total / vLLM's |",
        "|---:|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ratio = float(r["total"]) / float(stock[(r["batch"], r["kind"])])  # type: ignore[arg-type]
        lines.append(
            f"| {r['batch']} | {r['kind']} | {LABEL[str(r['mode'])]} | {r['admit']:.1f} "
            f"| {r['schedule']:.1f} "
            f"| {r['update']:.1f} | {r['total']:.1f} | {r['steps']:g} | {ratio:.2f} |"
        )
    shared = max(
        float(r["total"])  # type: ignore[arg-type]
        for r in rows
        if r["batch"] == max(stock)[0] and r["kind"] == "shared"
    )
    budget_us = 1e6 / BEST_SHARED_RATE
    two = {(r["batch"], r["kind"]): r["total"] for r in rows if r["mode"] == "two_step"}
    change = max(
        abs(float(r["total"]) / float(two[(r["batch"], r["kind"])]) - 1)  # type: ignore[arg-type]
        for r in rows
        if r["mode"] == "one_step"
    )
    lines += [
        "",
        f"At the card's best one-question-set rate so far ({BEST_SHARED_RATE:g} reads/s at "
        f"batch 256, an H200 as the 24 GB card, 2026-12-04) a read has {budget_us:,.0f} µs "
        f"of the engine core's time; the scheduler's work per read, at most {shared:.0f} µs "
        f"on this slower CPU, is at most {100 * shared / budget_us:.0f}% of it. One-step reads "
        f"change it by at most {100 * change:.0f}% against the same scheduler's two steps: "
        "their gain is the forward pass they save, not the scheduler's Python.",
    ]
    lines += [
        "",
        "Reproduce:",
        "",
        "```",
        "python bench/scheduler_host.py",
        "```",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", default="32,256")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--passes", type=int, default=3)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    rows = measure(batches, args.rounds, args.passes)
    md = render(rows, args.rounds, args.passes)
    print(md)
    if not args.no_write:
        from bench.report import write_section

        write_section("scheduler-host", md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

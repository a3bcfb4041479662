"""vLLM's host work per read outside the GPU worker, on the CPU, in two tables:

- the engine core's scheduler: vLLM 0.33's real diffusion scheduler, its requests, KV
  block pool and prefix cache (SHA-256 block hashes, vLLM's default), driven as async
  scheduling drives it, with the runner's output made up (bench/harness/vllm_scheduler.py);
  side by side in one run: vLLM's own scheduler, the plugin's with reads in two steps, the
  plugin's with one-step reads;
- the front end: the engine's sampling params, vLLM's input and output processors, the
  messages both ways and the engine's `parse_output` (bench/harness/vllm_frontend.py).

Prints the tables and writes docs/benchmarks.md's section.

    python bench/engine_host.py [--batches 32,256] [--rounds 6] [--passes 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.harness.vllm_frontend import FRONT, frontend_cost
from bench.harness.vllm_model import write_model_dir
from bench.harness.vllm_scheduler import BUDGET, PROMPT, WIDTH, host_cost

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


def measure_front(batch: int, rounds: int) -> dict[str, dict[str, float]]:
    """{kind: µs per read in each front-end phase}, at `batch` reads per batch."""
    front = {kind: frontend_cost(batch, kind, rounds) for kind in ("shared", "unique")}
    for kind, got in front.items():
        print(kind, {k: round(v, 1) for k, v in got.items()}, flush=True)
    return front


def render(
    rows: list[dict[str, object]],
    front: dict[str, dict[str, float]],
    front_batch: int,
    rounds: int,
    passes: int,
) -> str:
    stock = {(r["batch"], r["kind"]): r["total"] for r in rows if r["mode"] == "stock"}
    lines = [
        "## vLLM's host work per read outside the GPU worker (CPU)",
        "",
        "What vLLM's engine core spends in its scheduler for each read, measured here on the "
        "CPU: vLLM 0.33's diffusion scheduler (the real class, requests, KV block pool and "
        "prefix cache with SHA-256 block hashes, vLLM's default) driven as async scheduling "
        "drives it (two steps in flight), the runner's output made up, in steps of the "
        f"product's {BUDGET:,}-token budget (`max_num_batched_tokens`). Reads as the card "
        f"runs': {PROMPT}-token prompts, {WIDTH}-position canvases (`shared`: one prompt for "
        "the whole batch, as one question set; `unique`: each its own). `admit` is "
        "the request with its prompt's block hashes and `add_request()`, `schedule` is "
        "`schedule()`, `update` is `update_from_output()`, µs per read, medians of "
        f"{passes} interleaved passes of {rounds} batches each; `steps` is engine steps per "
        "batch. The µs are this machine's (2 cores of a development VM); a GPU host's CPU "
        "is likely faster, the ratios carry over.",
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
    phases = " | ".join(f"{k} µs" for k in FRONT)
    lines += [
        "",
        f"The front end, batch {front_batch}, µs per read in each phase (medians of {rounds} "
        "batches): `params`, the engine's `build_sampling_params`; `inputs`, vLLM's "
        "`InputProcessor.process_inputs` and its request id; `track`, "
        "`OutputProcessor.add_request`; `send`, the request's msgpack; `receive`, the engine "
        "core's outputs decoded; `outputs`, `OutputProcessor.process_outputs` (the flat "
        "logprobs of 16 positions); `parse`, the engine's `parse_output` (three slots' "
        "probabilities). The engine core's side of the messages (`core`: the request "
        "decoded, the outputs encoded) goes with the engine core's time. Not counted: "
        "asyncio's tasks and queues around each request.",
        "",
        f"| kind | {phases} | front end µs/read | engine core's side µs/read |",
        "|---|" + "---:|" * (len(FRONT) + 2),
    ]
    for kind, got in front.items():
        cells = " | ".join(f"{got[k]:.1f}" for k in FRONT)
        lines.append(f"| {kind} | {cells} | {got['front']:.1f} | {got['core']:.1f} |")
    top = max(int(r["batch"]) for r in rows)  # type: ignore[call-overload]
    shared = max(
        float(r["total"])  # type: ignore[arg-type]
        for r in rows
        if r["batch"] == top and r["kind"] == "shared"
    )
    core = shared + front["shared"]["core"]
    fe = front["shared"]["front"]
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
        "of each process's time. On this machine's CPU the engine core's scheduler and its "
        f"side of the messages take at most {core:.0f} µs of it "
        f"({100 * core / budget_us:.0f}%), the front end {fe:.0f} µs "
        f"({100 * fe / budget_us:.0f}%, asyncio's part not counted): neither comes near "
        "bounding that row alone. What is left of the engine core's thread is vLLM's GPU "
        "worker in the same process (its admission of each request, its input preparation, "
        "the forward's Python between graph pieces) and its waits for the GPU: the part to "
        "profile on the card with the mended sampler. One-step reads change the "
        f"scheduler's work by at most {100 * change:.0f}% against the same scheduler's "
        "two steps: their gain is the forward pass they save, not the scheduler's Python.",
    ]
    lines += [
        "",
        "Reproduce:",
        "",
        "```",
        "python bench/engine_host.py",
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
    front = measure_front(max(batches), args.rounds)
    md = render(rows, front, max(batches), args.rounds, args.passes)
    print(md)
    if not args.no_write:
        from bench.report import write_section

        write_section("engine-host", md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

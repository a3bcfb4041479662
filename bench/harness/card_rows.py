"""The card benchmark's rows and their section (bench/engine_vllm.py runs them on the GPU
machine; tests/bench/test_engine_vllm_rows.py checks them on the CPU).

- `measure`: per batch size, kind (unique prompts, one question set) and number of batches
  in flight, the engine's reads/s and each read's latency; the reads are made before a
  row's clock starts;
- `render_scheduling`: card runs of one device session side by side, the product's
  defaults' column marking the figures other pages quote;
- `render_steps`: one engine start's rows with one-step reads beside the same engine's
  reads taking vLLM's two steps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.harness.figures import figure

__all__ = [
    "SCHEDULING_COMMAND",
    "SCHEDULING_DEFAULTS",
    "SESSIONS",
    "in_flight_depths",
    "measure",
    "percentile",
    "probe",
    "probe_agreement",
    "render_scheduling",
    "render_steps",
    "run_label",
    "scheduling_name",
    "stack_samples",
    "uniform_spread",
]


@contextlib.contextmanager
def stack_samples(label: str) -> Iterator[None]:
    """The host-side sampler's row (bench/gpu/card/dgstacks.py): every process samples its
    threads while the flag file names a row. Nothing happens without DGSTREAM_STACKS."""
    directory = os.environ.get("DGSTREAM_STACKS")
    if not directory:
        yield
        return
    flag = Path(directory) / "row"
    flag.parent.mkdir(parents=True, exist_ok=True)
    flag.write_text(label)
    try:
        yield
    finally:
        flag.unlink(missing_ok=True)


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def in_flight_depths(spec: str | int) -> list[int]:
    """`--in-flight` as depths: "1,2,4" -> [1, 2, 4] (an int from older callers kept)."""
    depths = [int(x) for x in str(spec).split(",") if x.strip()]
    if not depths or min(depths) < 1:
        raise ValueError(f"--in-flight: batches in flight must be >= 1, got {spec!r}")
    return depths


async def measure(
    engine: Any, args: argparse.Namespace, vocab: int, peak: Any = None, seed: int = 0
) -> list[dict[str, Any]]:
    from bench.harness.reads import make_reads

    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    shared_prefix = [make_reads(1, args.prompt, args.canvas, args.shared, vocab, rng)[0]]
    depths = in_flight_depths(args.in_flight)
    for b, kind, depth in (
        (b, kind, depth)
        for b in [int(x) for x in args.batches.split(",")]
        for kind in ("unique", "shared")
        for depth in depths
    ):
        # At least 3 batches a row (one batch of 256 is well under a second on the GPU),
        # and 3 per batch in flight, so a deeper row keeps its depth most of the row.
        repeats = max(3 * depth, min(64, 256 // b))

        def batch(kind: str = kind, b: int = b) -> list[Any]:
            if kind == "unique":
                return make_reads(b, args.prompt, args.canvas, 0, vocab, rng)
            # One question set: every prompt starts with the same shared prefix.
            pre = shared_prefix[0].prompt_ids[: args.shared]
            reads = make_reads(b, args.prompt, args.canvas, 0, vocab, rng)
            return [
                type(r)(pre + r.prompt_ids[args.shared :], r.canvas_ids, r.slots, args.shared)
                for r in reads
            ]

        await engine.read(batch())  # warm-up (and, shared: the prefix into the cache)
        latencies: list[float] = []
        # The row's reads are made before its clock starts: making 256 random prompts takes
        # tens of ms of this process's Python, which a worker's batches (read from Kafka)
        # do not cost the engine.
        batches = [batch() for _ in range(repeats)]
        if peak is not None:
            peak.busy_begin()
        # --in-flight N: N batches at once, as the worker keeps them (1: one after another).
        slots = asyncio.Semaphore(depth)

        async def one_batch(
            reads: list[Any],
            slots: asyncio.Semaphore = slots,
            latencies: list[float] = latencies,
        ) -> None:
            async with slots:
                out = await engine.read(reads)
                latencies.extend(r.timings["engine_s"] for r in out)

        label = f"b{b}_{kind}" + (f"_x{depth}" if len(depths) > 1 else "")
        with stack_samples(label + (f"_s{seed}" if seed else "")):
            t0 = time.perf_counter()
            await asyncio.gather(*(one_batch(reads) for reads in batches))
            seconds = time.perf_counter() - t0
        busy = peak.busy_end() if peak is not None else None
        row = {
            "variant": f"vllm/{kind}",
            "batch": b,
            "reads_per_s": b * repeats / seconds,
            "p50_ms": statistics.median(latencies) * 1e3,
            "p99_ms": percentile(latencies, 0.99) * 1e3,
            "reads": b * repeats,
            "gpu_busy_pct": busy,
            "in_flight": depth,
        }
        rows.append(row)
        print(
            f"{row['variant']:14s} batch {b:4d} x{depth}: {row['reads_per_s']:8.1f} reads/s  "
            f"p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms  "
            f"GPU busy {busy}%" + (" (two steps)" if getattr(engine, "two_step", False) else ""),
            flush=True,
        )
    return rows


# Reads the probe makes: half unique prompts, half one question set, in one batch, so its
# steps mix new prompts with canvases (the steps whose CUDA graph mode differs).
PROBE_READS = 64


async def probe(engine: Any, args: argparse.Namespace, vocab: int) -> list[list[list[float]]]:
    """Every slot's label probabilities for the same reads in every run (a fixed seed,
    apart from the rows' own), so two engine settings' answers can be held side by side
    (`probe_agreement`)."""
    from bench.harness.reads import make_reads

    rng = random.Random(7)
    half = PROBE_READS // 2
    pre = make_reads(1, args.prompt, args.canvas, 0, vocab, rng)[0].prompt_ids[: args.shared]
    shared = [
        type(r)(pre + r.prompt_ids[args.shared :], r.canvas_ids, r.slots, args.shared)
        for r in make_reads(half, args.prompt, args.canvas, 0, vocab, rng)
    ]
    reads = make_reads(half, args.prompt, args.canvas, 0, vocab, rng) + shared
    out = await engine.read(reads)
    return [[[float(p) for p in slot.probs] for slot in r.slots] for r in out]


def probe_agreement(a: list[list[list[float]]], b: list[list[list[float]]]) -> dict[str, Any]:
    """How far two runs' probes are apart: slots compared, slots whose most likely label
    differs, and the largest gap between two probabilities of the same label."""
    if [[len(slot) for slot in read] for read in a] != [[len(slot) for slot in read] for read in b]:
        raise ValueError("the probes are not of the same reads")
    slots = [(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True)]
    differ = sum(
        max(range(len(x)), key=x.__getitem__) != max(range(len(y)), key=y.__getitem__)
        for x, y in slots
    )
    gap = max((abs(p - q) for x, y in slots for p, q in zip(x, y, strict=True)), default=0.0)
    return {"slots": len(slots), "answers_differ": differ, "max_probability_gap": gap}


def uniform_spread(probe: list[list[list[float]]]) -> float:
    """How far a probe's probabilities stray from an even split over each slot's labels:
    near 0, the model (dummy weights) prefers no label."""
    return max(
        (abs(p - 1 / len(slot)) for read in probe for slot in read for p in slot), default=0.0
    )


# --- docs/benchmarks.md: scheduling and batches in flight on the card -------------------------

SCHEDULING_COMMAND = (
    "# on the GPU machine, one device session (the staged parts first):\n"
    "BATCHES=1,256 bash bench/gpu/vllm_session.sh card sched_sync --in-flight 1,2,4 "
    "--no-async-scheduling\n"
    "BATCHES=1,256 bash bench/gpu/vllm_session.sh card sched_async --in-flight 1,2,4 "
    "--async-scheduling\n"
    "BATCHES=1,256 bash bench/gpu/vllm_session.sh card async_canvas16 --in-flight 1,4 "
    "--served-canvas 16\n"
    "bash bench/gpu/vllm_session.sh tests   # the answers, with async scheduling the default\n"
    "# here: this section\n"
    "python bench/engine_gpu.py --render-scheduling docs/data/card24/card_sched_sync.json "
    "docs/data/card24/card_sched_async.json docs/data/card24/card_async_canvas16.json "
    "--date 2026-12-03"
)


# The defaults these runs chose (2026-12-03): the column whose figures other pages quote.
# Fixed here, not read from VllmSettings, so the section re-renders the same after the
# defaults move on. The kernels are vLLM's own choice (None); runs made before the kernel
# settings existed have no such keys and chose none.
SCHEDULING_DEFAULTS = {
    "async_scheduling": True,
    "canvas_length": 64,
    "moe_backend": None,
    "linear_backend": None,
    "cudagraph_mode": None,
}


# VllmSettings' default share of the card, as the card runs had it: a run with another names it.
DEFAULT_UTILIZATION = 0.9


def scheduling_name(settings: dict[str, Any]) -> str:
    """A run's `async_scheduling` setting in words."""
    names = {None: "async (vLLM default)", True: "async", False: "sync"}
    return names[settings["async_scheduling"]]


def run_label(
    info: dict[str, Any], one_step_default: str | bool = False, graphs_default: int = 0
) -> str:
    """A card run's engine settings in a few words: scheduling, the served canvas and, when
    chosen, vLLM's kernels (runs before the setting existed chose none). `one_step_default`
    and `graphs_default`: one_step_reads' and full_graph_tokens' defaults for the session
    (`render_scheduling` says which)."""
    s = info["settings"]
    label = f"{scheduling_name(s)}, canvas {s['canvas_length']}"
    if s.get("read_path") == "stock":
        label = f"vLLM's own read path, {label}"
    kernels = {s.get("moe_backend"), s.get("linear_backend")} - {None}
    if kernels:
        label += ", " + "/".join(sorted(kernels)) + " kernels"
    if s.get("cudagraph_mode"):
        label += f", {s['cudagraph_mode']} graphs"
    graphs = s.get("full_graph_tokens") or 0
    if graphs:
        label += f", FULL graphs to {graphs} tokens"
    elif graphs_default:
        label += ", mixed steps piecewise (full_graph_tokens 0)"
    # vLLM's own read path has no one-step reads, whatever the setting said; two steps are
    # named only where they were chosen against the default of the run's day.
    one_step = s.get("one_step_reads") if s.get("read_path") != "stock" else None
    if one_step is True:
        label += ", one-step reads"
    elif one_step == "auto":
        label += ", one-step reads auto"
    elif one_step is False and one_step_default is not False:
        label += ", two steps (one-step reads false)"
    share = s.get("gpu_memory_utilization")
    if share is not None and share != DEFAULT_UTILIZATION:
        label += f", gpu_memory_utilization {share}"
    return label


# The device sessions rendered by `render_scheduling`: docs/benchmarks.md's section name ->
# (its title, the commands that reproduce it). One section per session, so that a later
# session's columns never replace an earlier one's figures.
SESSIONS: dict[str, tuple[str, str]] = {
    "card24-scheduling": (
        "Scheduling and batches in flight on the emulated 24 GB card",
        SCHEDULING_COMMAND,
    ),
    "card24-side-by-side": (
        "The 24 GB card side by side: the read path, FULL graphs, vLLM's own path",
        "bash bench/gpu/stage.sh   # here; then the parts to the GPU machine (stage.sh says how)\n"
        "# on the GPU machine, one device session:\n"
        "bash bench/gpu/vllm_session.sh card sbs_defaults --in-flight 1,4\n"
        "bash bench/gpu/vllm_session.sh card sbs_full --in-flight 1,4 --cudagraph-mode FULL "
        "--gpu-memory-utilization 0.86\n"
        "bash bench/gpu/vllm_session.sh card sbs_stock --read-path stock --served-canvas 16 "
        "--max-model-len 4096\n"
        "bash bench/gpu/peer_session.sh --max-model-len 4096\n"
        "# here: this section (the first run is the baseline of the ratios)\n"
        "python bench/engine_gpu.py --section card24-side-by-side --render-scheduling "
        "docs/data/card24/sbs/card_sbs_defaults.json docs/data/card24/sbs/card_sbs_full.json "
        "docs/data/card24/sbs/card_sbs_stock.json --date DATE",
    ),
    # Whether one-step reads become the default: the defaults against one-step reads (the
    # stall fix in), each its own engine start, at the depths the worker keeps (2) and
    # where the first one-step run stalled (4). The one-step run's own two-step rows go to
    # `render_steps` (section card24-one-step-fix).
    "card24-one-step-default": (
        "Whether one-step reads become the default: two engine starts on the emulated card",
        "bash bench/gpu/stage.sh   # here; then the parts to the GPU machine (stage.sh says how)\n"
        "# on the GPU machine, one device session:\n"
        'PYTEST_K="one_step" bash bench/gpu/vllm_session.sh tests   # the answers\n'
        "BATCHES=1,256 bash bench/gpu/vllm_session.sh card one_step_fix --in-flight 1,2,4 "
        "--one-step-reads --beside-two-step\n"
        "BATCHES=1,256 bash bench/gpu/vllm_session.sh card osd_defaults --in-flight 1,2,4\n"
        "# here: this section (the defaults' run is the baseline of the ratios)\n"
        "python bench/engine_gpu.py --section card24-one-step-default --render-scheduling "
        "docs/data/card24/one_step/card_osd_defaults.json "
        "docs/data/card24/one_step/card_one_step_fix.json --date DATE",
    ),
    # The default since 2026-12-06 (one_step_reads auto: one step while no request waits)
    # against the default before it (false), one session, at the worker's depths and
    # beyond; batch 32 too, between the lone read and the backlog.
    "card24-auto": (
        "The auto default against two steps always: two engine starts on the emulated card",
        "bash bench/gpu/stage.sh   # here; then the parts to the GPU machine (stage.sh says how)\n"
        "# on the GPU machine, one device session:\n"
        'PYTEST_K="not one_step" bash bench/gpu/vllm_session.sh tests   # the answers, auto\n'
        "BATCHES=1,32,256 bash bench/gpu/vllm_session.sh card two_steps --in-flight 1,2,4 "
        "--one-step-reads false\n"
        "BATCHES=1,32,256 bash bench/gpu/vllm_session.sh card auto --in-flight 1,2,4\n"
        "# the same session, for the peer's table (section peer-auto):\n"
        "bash bench/gpu/peer_session.sh --max-model-len 4096\n"
        "BATCHES=1,32,256 bash bench/gpu/vllm_session.sh card stock --read-path stock "
        "--served-canvas 16 --max-model-len 4096\n"
        "# here: this section (two steps' run is the baseline of the ratios)\n"
        "python bench/engine_gpu.py --section card24-auto --render-scheduling "
        "docs/data/card24/auto/card_two_steps.json docs/data/card24/auto/card_auto.json "
        "--date DATE",
    ),
    # FULL CUDA graphs with one-step reads (their ranges through one persistent buffer)
    # against the defaults, one session; the peer and the pipeline in the same session.
    "card24-full-one-step": (
        "FULL graphs with one-step reads against the defaults: two engine starts on the card",
        "bash bench/gpu/stage.sh bench/gpu/vllm-wheels.txt bench/gpu/pipeline-wheels.txt   "
        "# here; then the parts to the GPU machine (stage.sh says how)\n"
        "# on the GPU machine, one device session:\n"
        'PYTEST_K="one_step and full" bash bench/gpu/vllm_session.sh tests   # the answers\n'
        "BATCHES=1,32,256 bash bench/gpu/vllm_session.sh card full_one_step --in-flight 1,2 "
        "--cudagraph-mode FULL --gpu-memory-utilization 0.86\n"
        "BATCHES=1,32,256 bash bench/gpu/vllm_session.sh card defaults --in-flight 1,2\n"
        "# the same session, for the peer's table (section peer-full-one-step):\n"
        "bash bench/gpu/peer_session.sh --max-model-len 4096\n"
        "# here: this section (the defaults' run is the baseline of the ratios)\n"
        "python bench/engine_gpu.py --section card24-full-one-step --render-scheduling "
        "docs/data/card24/full_one_step/card_defaults.json "
        "docs/data/card24/full_one_step/card_full_one_step.json --date DATE",
    ),
    # FULL graphs for small mixed steps (full_graph_tokens 1,024, the default since)
    # against the defaults before them, one session.
    "card24-small-full": (
        "FULL graphs for small mixed steps against the defaults before them: two engine "
        "starts on the card",
        "bash bench/gpu/stage.sh   # here; then the parts to the GPU machine (stage.sh says how)\n"
        "# on the GPU machine, one device session:\n"
        'PYTEST_K="one_step and full" bash bench/gpu/vllm_session.sh tests   # the answers\n'
        "BATCHES=1,32,256 bash bench/gpu/vllm_session.sh card small_full --in-flight 1,2 "
        "--full-graph-tokens 1024\n"
        "BATCHES=1,32,256 bash bench/gpu/vllm_session.sh card defaults --in-flight 1,2 "
        "--full-graph-tokens 0\n"
        "# here: this section (the run with mixed steps piecewise is the baseline of the "
        "ratios)\n"
        "python bench/engine_gpu.py --section card24-small-full --render-scheduling "
        "docs/data/card24/small_full/card_defaults.json "
        "docs/data/card24/small_full/card_small_full.json --date DATE",
    ),
    # The defaults (full_graph_tokens 1,024) beside the peer, one session: the run the
    # peer's table (section peer-small-full) sets against `vllm serve`.
    "card24-peer-small-full": (
        "The defaults beside the peer: one engine start on the card",
        "bash bench/gpu/stage.sh   # here; then the parts to the GPU machine (stage.sh says how)\n"
        "# on the GPU machine, one device session:\n"
        "BATCHES=1,32,256 bash bench/gpu/vllm_session.sh card defaults --in-flight 1,2\n"
        "bash bench/gpu/peer_session.sh --max-model-len 4096   # section peer-small-full\n"
        'PYTEST_K="not one_step" bash bench/gpu/vllm_session.sh tests   # the answers\n'
        'PYTEST_K="one_step and full and not small_full" bash bench/gpu/vllm_session.sh tests\n'
        'PYTEST_K="one_step and graphs" bash bench/gpu/vllm_session.sh tests\n'
        "# here: this section\n"
        "python bench/engine_gpu.py --section card24-peer-small-full --render-scheduling "
        "docs/data/card24/peer_small_full/card_defaults.json --date DATE",
    ),
}


# full_graph_tokens' default for a section's runs, where it is not 0: it was 0 (the setting
# absent, or measured against) until the session that made 1,024 the default.
GRAPHS_DEFAULT: dict[str, int] = {"card24-small-full": 1024, "card24-peer-small-full": 1024}


def render_scheduling(paths: list[Path], date: str = "", section: str = "card24-scheduling") -> str:
    """The card runs of one device session side by side, one column per engine start (its
    scheduling, its served canvas, its read path), one row per batch, kind and batches in
    flight; each later column also as a ratio to the first, and its probe's answers held
    against the first's. `section` names the session (`SESSIONS`)."""
    title, command = SESSIONS[section]
    runs = [json.loads(p.read_text()) for p in paths]
    # A run with one-step reads beside two (`--beside-two-step`) also holds its two-step
    # rows: its column is its own reads' (`render_steps` sets the two side by side).
    keyed = [
        {
            (r["batch"], r["variant"], r.get("in_flight", 1)): r
            for r in b["rows"]
            if r.get("steps", 1) == 1
        }
        for b in runs
    ]
    keys = sorted(
        {k for rows in keyed for k in rows}, key=lambda k: (k[0], k[1] != "vllm/unique", k[2])
    )
    # one_step_reads defaulted to false until 2026-12-06 and to "auto" since: a session
    # with an "auto" run made it after the change, and its false run is a chosen setting.
    one_step_default: str | bool = (
        "auto"
        if any(b["info"]["settings"].get("one_step_reads") == "auto" for b in runs)
        else False
    )
    graphs_default = GRAPHS_DEFAULT.get(section, 0)
    labels = [run_label(b["info"], one_step_default, graphs_default) for b in runs]
    # Sessions ran on H200s and on H100s: a session's figures are its GPU's.
    gpus = {b["info"].get("gpu") for b in runs}
    on_gpu = f" on one {gpus.pop()}" if len(gpus) == 1 and None not in gpus else ""
    head = "| batch | kind | batches in flight | " + " | ".join(labels)
    head += "".join(f" | {lab} / {labels[0]}" for lab in labels[1:]) + " |"
    lines = [
        f"## {title}" + (f" ({date})" if date else ""),
        "",
        "The card runs' reads (256-token prompts, 16-position canvases with 3 slots, "
        "constrained, the full-size NVFP4 shape with dummy weights; `shared`: one question "
        "set) with the product's defaults but for the column's settings, one engine start a "
        f"column, one device session{on_gpu}. A row holds `batches in flight` batches of "
        "`batch` "
        "reads at the engine at once, as the worker keeps its batches; each batch's reads "
        "are made before the row's clock starts. Reads/s (p50 / p99 ms per read; GPU busy %, "
        "NVML):",
        "",
        head,
        "|---:|---|---:|" + "---:|" * (2 * len(runs) - 1),
    ]

    # The product's defaults' column: its figures are the ones other pages quote.
    defaults = next(
        (
            i
            for i, b in enumerate(runs)
            if all(b["info"]["settings"].get(k) == v for k, v in SCHEDULING_DEFAULTS.items())
            and b["info"]["settings"].get("read_path", "dgstream") == "dgstream"
            and b["info"]["settings"].get("gpu_memory_utilization", DEFAULT_UTILIZATION)
            == DEFAULT_UTILIZATION
            and (b["info"]["settings"].get("one_step_reads") or False) == one_step_default
            and (b["info"]["settings"].get("full_graph_tokens") or 0) == graphs_default
        ),
        None,
    )

    def cell(row: dict[str, Any] | None, name: str | None) -> str:
        if row is None:
            return "-"
        busy = row.get("gpu_busy_pct")
        busy_s = f"; {busy:.0f}%" if isinstance(busy, int | float) else ""
        rate, p50 = f"{row['reads_per_s']:.1f}", f"{row['p50_ms']:.0f}"
        if name:
            rate, p50 = figure(name, rate), figure(f"{name}_p50", p50)
        return f"{rate} ({p50} / {row['p99_ms']:.0f}{busy_s})"

    for key in keys:
        cells = [rows.get(key) for rows in keyed]
        b, variant, depth = key
        name = f"defaults_{variant.split('/')[1]}_b{b}_x{depth}"
        first = cells[0]
        ratios = [
            f"{c['reads_per_s'] / first['reads_per_s']:.2f}x" if c and first else "-"
            for c in cells[1:]
        ]
        lines.append(
            f"| {b} | {variant.split('/')[1]} | {depth} | "
            + " | ".join(cell(c, name if i == defaults else None) for i, c in enumerate(cells))
            + "".join(f" | {r}" for r in ratios)
            + " |"
        )
    lines += [
        "",
        "KV cache tokens are vLLM's own count: the requests of max_model_len that its blocks "
        "hold, times max_model_len. It counts a request's worst case, which differs with "
        "the scheduling for the same blocks.",
        "",
        "Engine starts: "
        + "; ".join(
            f"{lab}: {b['info'].get('kv_blocks') or 0:,} KV blocks, vLLM's count "
            f"{b['info']['kv_cache_tokens']:,} tokens, {b['info']['start_s']:.0f} s"
            for lab, b in zip(labels, runs, strict=True)
        )
        + ".",
    ]
    # The same fixed probe batch (half unique prompts, half one question set) in every run.
    held = [
        (lab, probe_agreement(runs[0]["probe"], b["probe"]))
        for lab, b in zip(labels[1:], runs[1:], strict=True)
        if runs[0].get("probe") and b.get("probe")
    ]
    if held:
        lines += [
            "",
            f"The probe's answers against {labels[0]}'s: "
            + "; ".join(
                f"{lab}: {a['answers_differ']} of {a['slots']} slots answer otherwise, "
                f"probabilities at most {a['max_probability_gap']:.4f} apart"
                for lab, a in held
            )
            + ".",
        ]
        if all(b["info"].get("settings", {}).get("load_format") == "dummy" for b in runs):
            spread = max(uniform_spread(b["probe"]) for b in runs if b.get("probe"))
            lines[-1] += (
                f" On dummy weights this says nothing of the answers: every slot's "
                f"probabilities lie within {spread:.3f} of an even split in every run, so "
                "rounding picks the most likely label and the runs differ by as much as each "
                "spreads. The answers are held side by side on the demo model (the gpu tests)."
            )
    lines += ["", "Reproduce:", "", "```", command.replace("DATE", date or "DATE"), "```"]
    return "\n".join(lines)


# --- docs/benchmarks.md: one-step reads against two steps, one engine ------------------------


def _steps_command(section: str, name: str, in_flight: str, tests: str) -> str:
    return (
        "bash bench/gpu/stage.sh   # here; then the parts to the GPU machine (stage.sh says how)\n"
        "# on the GPU machine, one device session:\n"
        f'PYTEST_K="{tests}" bash bench/gpu/vllm_session.sh tests   # the answers\n'
        f"BATCHES=1,256 bash bench/gpu/vllm_session.sh card {name} --in-flight {in_flight} "
        "--one-step-reads --beside-two-step\n"
        "# here: this section\n"
        f"python bench/engine_gpu.py --section {section} --render-steps "
        f"docs/data/card24/one_step/card_{name}.json --date DATE"
    )


# The device sessions rendered by `render_steps`, as `SESSIONS` for `render_scheduling`:
# the section's name -> the commands that reproduce it. One section per session, so that
# the measurement of a fix stands beside the run it fixes instead of replacing it.
STEP_SESSIONS: dict[str, str] = {
    # The first run: one batch and four in flight (2026-12-05).
    "card24-one-step": _steps_command("card24-one-step", "one_step", "1,4", "one_step and graphs"),
    # The attention kernel's variant with ranges compiled at warmup (the ranges on every
    # step), measured at the depths the worker and the stalled rows ran at.
    "card24-one-step-fix": _steps_command(
        "card24-one-step-fix", "one_step_fix", "1,2,4", "one_step"
    ),
}


def render_steps(path: Path, date: str = "", section: str = "card24-one-step") -> str:
    """One engine start with one-step reads (`--one-step-reads --beside-two-step`): each
    row's one-step figures beside the same engine's reads opting out (vLLM's two steps,
    other reads of the same shapes), and the ratio. The batch-1 p50s are figures.
    `section` names the session (`STEP_SESSIONS`)."""
    command = STEP_SESSIONS[section]
    run = json.loads(path.read_text())
    info = run["info"]
    keyed: dict[int, dict[tuple[int, str, int], dict[str, Any]]] = {1: {}, 2: {}}
    for r in run["rows"]:
        keyed[r.get("steps", 1)][(r["batch"], r["variant"], r.get("in_flight", 1))] = r
    keys = sorted(set(keyed[1]) | set(keyed[2]), key=lambda k: (k[0], k[1] != "vllm/unique", k[2]))

    def cell(row: dict[str, Any] | None, name: str | None = None) -> str:
        if row is None:
            return "-"
        busy = row.get("gpu_busy_pct")
        busy_s = f"; {busy:.0f}%" if isinstance(busy, int | float) else ""
        p50 = f"{row['p50_ms']:.1f}"
        if name:
            p50 = figure(name, p50)
        return f"{row['reads_per_s']:.1f} ({p50} / {row['p99_ms']:.0f}{busy_s})"

    gpu = info.get("gpu") or "GPU"
    lines = [
        "## One-step reads against vLLM's two steps, one engine on the emulated 24 GB card"
        + (f" ({date})" if date else ""),
        "",
        "One engine start with `one_step_reads` on (the product's defaults otherwise), on one "
        f"{gpu} made to behave as the {info.get('card_gib') or 23.6} GiB card, the "
        "full-size NVFP4 shape with dummy weights. Each row ran twice on that engine: "
        "its reads in one step (a read's prompt and canvas in one forward pass), then other "
        "reads of the same shapes opting out (`dgstream_two_step`: vLLM's prompt step, then "
        "its canvas step). The reads are the card runs' (256-token prompts, 16-position "
        "canvases with 3 slots, constrained; `shared`: one question set). Reads/s (p50 / "
        "p99 ms per read; GPU busy %, NVML):",
        "",
        "| batch | kind | batches in flight | one step | two steps | one / two |",
        "|---:|---|---:|---:|---:|---:|",
    ]
    for key in keys:
        one, two = keyed[1].get(key), keyed[2].get(key)
        b, variant, depth = key
        kind = variant.split("/")[1]
        name = f"one_step_{kind}_b{b}_p50" if b == 1 and depth == 1 else None
        ratio = f"{one['reads_per_s'] / two['reads_per_s']:.2f}x" if one and two else "-"
        lines.append(
            f"| {b} | {kind} | {depth} | {cell(one, name)} | "
            f"{cell(two, name and name.replace('one_step', 'two_step'))} | {ratio} |"
        )
    lines += [
        "",
        f"Engine start: {info.get('kv_blocks') or 0:,} KV blocks, vLLM's count "
        f"{info['kv_cache_tokens']:,} tokens, {info['start_s']:.0f} s.",
        "",
        "Reproduce:",
        "",
        "```",
        command.replace("DATE", date or "DATE"),
        "```",
    ]
    return "\n".join(lines)

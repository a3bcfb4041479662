"""vLLM rows of the engine benchmark: the full-size DiffusionGemma shape with vLLM's dummy
weights (no download), bf16 or NVFP4, inside a GPU memory budget, through `VllmEngine`.

Run on the GPU machine (`bench/engine_gpu.py --engine vllm` calls this), one process per
configuration: a vLLM instance holds its share of the card until the process ends.

    python3 bench/engine_gpu.py --engine vllm --quant nvfp4 --budget-gib 24 --out vllm_nvfp4.json

What it measures, per batch size, on the same read shapes as the transformers rows
(`bench.engine_gpu.make_reads`: 256-token prompts, a 16-token canvas, 3 answer slots):
- `unique`: prompts that share nothing (fresh ones every repeat: prefix caching is on and
  would otherwise answer repeats from the cache);
- `shared`: one question set, a 224-token prefix common to every prompt (prefix-cache hits).
Reads/s over all repeats, and p50/p99 of each read's own latency (submit to result). Memory:
the weights (vLLM's log), KV cache tokens (its block count), and the card's peak use
(NVML, sampled every 50 ms).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# The rows' harness and their section (bench/harness/card_rows.py: the tests check it there).
from bench.harness.card_rows import measure, probe, scheduling_name
from bench.harness.full_size import full_size_dir, stable_root

# Every label id `bench.engine_gpu.make_reads` puts on a canvas.
SHARED_LABELS = (100, 101, 200, 201, 202, 203, 300, 301, 302, 303, 304)
# `--one-step-reads VALUE` -> VllmSettings.one_step_reads (unset: the settings' default).
ONE_STEP_CHOICES: dict[str, bool | str] = {"true": True, "false": False, "auto": "auto"}


@contextlib.contextmanager
def tee_output(into: list[str]) -> Iterator[None]:
    """Copy everything written to fds 1 and 2 (this process and its children: vLLM's engine
    core logs to both) into `into`, while still writing it out."""
    saved = {fd: os.dup(fd) for fd in (1, 2)}
    threads = []
    for fd in (1, 2):
        r, w = os.pipe()
        os.dup2(w, fd)
        os.close(w)

        def pump(r: int = r, out: int = saved[fd]) -> None:
            with os.fdopen(r, "rb", buffering=0) as src:
                while chunk := src.read(65536):
                    into.append(chunk.decode(errors="replace"))
                    # The engine core (a child) may still write after the copy is closed.
                    with contextlib.suppress(OSError):
                        os.write(out, chunk)

        threads.append(threading.Thread(target=pump, daemon=True))
        threads[-1].start()
    try:
        yield
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        for fd, copy in saved.items():
            os.dup2(copy, fd)
            os.close(copy)
        for t in threads:
            t.join(2)


class PeakMemory:
    """The card's largest memory use, sampled with NVML (the engine lives in a child; this
    process never opens a CUDA context of its own)."""

    _STEP = 256 * 2**20  # a timeline point per 256 MiB moved: the start has a few dozen

    def __init__(self, every_s: float = 0.05) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.total = int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).total)
        self.name = str(pynvml.nvmlDeviceGetName(self._handle))
        self._every = every_s
        self.peak = 0
        self.processes: dict[int, float] = {}
        # (unix time, GiB used) whenever use moved by a step or more: when, in vLLM's
        # timestamped log, the start's transients happen.
        self.timeline: list[tuple[float, float]] = []
        self._last = -self._STEP
        # NVML's GPU utilisation (the share of its last sample period, 1/6 s to 1 s on
        # this driver, in which a kernel ran), collected between busy_begin and busy_end.
        self._busy: list[int] | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            used = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
            if used > self.peak:
                self.peak = used
                self.processes = self._processes()
            if abs(used - self._last) >= self._STEP:
                self.timeline.append((round(time.time(), 2), round(used / 2**30, 3)))
                self._last = used
            if self._busy is not None:
                with contextlib.suppress(self._nvml.NVMLError):
                    self._busy.append(
                        int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu)
                    )
            self._stop.wait(self._every)

    def _processes(self) -> dict[int, float]:
        """GiB per process on the card (the engine core, and whatever else holds memory)."""
        try:
            procs = self._nvml.nvmlDeviceGetComputeRunningProcesses(self._handle)
        except self._nvml.NVMLError:
            return {}
        return {int(p.pid): (p.usedGpuMemory or 0) / 2**30 for p in procs}

    def busy_begin(self) -> None:
        self._busy = []

    def busy_end(self) -> float | None:
        """The mean GPU busy % since busy_begin (None: no sample came)."""
        samples, self._busy = self._busy or [], None
        return round(statistics.mean(samples), 1) if samples else None

    def reset(self) -> int:
        """The peak so far; sampling goes on from zero (load-time transients stay apart)."""
        peak, self.peak = self.peak, 0
        return peak

    def close(self) -> int:
        self._stop.set()
        self._thread.join(1)
        return self.peak


async def profile(engine: Any, args: argparse.Namespace, vocab: int) -> None:
    """One torch-profiled batch of each kind (vLLM writes the traces and CUDA-time tables):
    batch 1 and 256 of unique prompts, and 256 of one question set (its prefix put in the
    cache by an unprofiled batch first, as measure() does)."""
    from bench.harness.reads import make_reads

    rng = random.Random(1)
    llm = engine._engine
    prefix = make_reads(1, args.prompt, args.canvas, 0, vocab, rng)[0].prompt_ids[: args.shared]

    def shared(b: int) -> list[Any]:
        return [
            type(r)(prefix + r.prompt_ids[args.shared :], r.canvas_ids, r.slots, args.shared)
            for r in make_reads(b, args.prompt, args.canvas, 0, vocab, rng)
        ]

    await engine.read(shared(256))
    for name, reads in (
        ("b1", make_reads(1, args.prompt, args.canvas, 0, vocab, rng)),
        ("b256", make_reads(256, args.prompt, args.canvas, 0, vocab, rng)),
        ("b256_shared", shared(256)),
    ):
        await llm.start_profile(profile_prefix=name)
        await engine.read(reads)
        await llm.stop_profile()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from dgstream.workers.engine.vllm.engine import VllmEngine
    from dgstream.workers.engine.vllm.settings import VllmSettings

    root = stable_root()  # one path on every start: the compile cache hits
    model = full_size_dir(args.quant, root)
    peak = PeakMemory()
    total_gib = peak.total / 2**30
    # Engine knobs left out take VllmSettings' defaults (the product's): the served canvas,
    # reads in flight, the token budget, gpu_memory_utilization (on the emulated card,
    # DGSTREAM_CARD_GIB, it means what it would on that card).
    knobs: dict[str, Any] = {
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "async_scheduling": args.async_scheduling,
        "canvas_length": args.served_canvas,
        "max_model_len": args.max_model_len,
        "moe_backend": args.moe_backend,
        "linear_backend": args.linear_backend,
        "cudagraph_mode": args.cudagraph_mode,
        "full_graph_tokens": args.full_graph_tokens,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "one_step_reads": ONE_STEP_CHOICES[args.one_step_reads] if args.one_step_reads else None,
    }
    if args.budget_gib:  # the runs before the emulated card: a share of the whole H200
        knobs["gpu_memory_utilization"] = round(args.budget_gib / total_gib, 4)
    settings = VllmSettings(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        enforce_eager=args.eager,
        cudagraph_capture_sizes="to_budget" if args.graphs == "budget" else None,
        diffusion_constrained=not args.unconstrained,
        profiler_dir=args.profile or None,
        read_path=args.read_path,
        **{k: v for k, v in knobs.items() if v is not None},
    )
    # The reads' labels (bench.engine_gpu.make_reads) as the one shared set, as the factory
    # gives a worker's engine its tokenizer's labels.
    engine = VllmEngine(settings, shared_labels=SHARED_LABELS)
    log: list[str] = []
    with tee_output(log):
        t0 = time.perf_counter()
        await engine.start()
        start_s = time.perf_counter() - t0
        start_peak, start_processes = peak.reset(), dict(peak.processes)
        cache = engine._engine.vllm_config.cache_config
        gmu_used = cache.gpu_memory_utilization
        len_used = engine._engine.model_config.max_model_len
        seqs_used = engine._engine.vllm_config.scheduler_config.max_num_seqs
        vocab = engine.info.vocab_size
        rows = await measure(engine, args, vocab, peak)
        one_step = settings.one_step_resolved(engine.read_path)[0]
        if one_step and settings.one_step_reads is True:
            # Every read in one step. Under "auto" a row's reads take one step or two
            # with the engine's backlog: its rows stand as the engine's own (no "steps").
            for row in rows:
                row["steps"] = 1
        if args.beside_two_step:
            # The same engine, its reads opting out of one step: vLLM's two steps, on the
            # same graphs and KV cache. Other reads (seed 1) so no prompt is in the cache.
            twos = await measure(engine.sibling(two_step=True), args, vocab, peak, seed=1)
            rows += [{**row, "steps": 2} for row in twos]
        # The same fixed reads in every run, for comparing two engine settings' answers.
        answers = await probe(engine, args, vocab)
        if args.profile:
            await profile(engine, args, vocab)
        await engine.close()
    text = "".join(log)
    loaded = re.findall(r"Model loading took ([0-9.]+) GiB", text)
    kv_tokens = re.findall(r"GPU KV cache size: ([0-9,]+) tokens", text)
    info = {
        "engine": "vllm",
        "read_path": engine.read_path,
        "one_step_reads": settings.one_step_reads,
        "one_step": one_step,
        "quant": args.quant,
        "gpu": peak.name,
        "gpu_total_gib": total_gib,
        "card_gib": float(os.environ.get("DGSTREAM_CARD_GIB") or 0) or None,
        "card_context_gib": float(os.environ.get("DGSTREAM_CARD_CONTEXT_GIB") or 0.5),
        "budget_gib": args.budget_gib,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "engine_gpu_memory_utilization": gmu_used,
        "max_num_seqs_used": seqs_used,
        "max_model_len_used": len_used,
        "start_s": start_s,
        "weights_gib": float(loaded[-1]) if loaded else None,
        "kv_cache_tokens": int(kv_tokens[-1].replace(",", "")) if kv_tokens else None,
        "kv_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        # Start (weights loaded, profiled, graphs captured) and serving, apart: the start
        # peaks above the budget (gpu_memory_utilization sizes the KV cache after it).
        "start_peak_gib": start_peak / 2**30,
        "start_peak_processes_gib": start_processes,
        "peak_gib": peak.close() / 2**30,
        "peak_processes_gib": peak.processes,
        "memory_timeline": peak.timeline,
        # Each process's own peak, as the card emulation saw it (bench/gpu/card).
        "process_peaks": card_reports(),
        "settings": settings.model_dump(),
    }
    brief = {k: v for k, v in info.items() if k not in ("settings", "memory_timeline")}
    print(f"# {json.dumps(brief)}", flush=True)
    return {"info": info, "rows": rows, "args": vars(args), "probe": answers}


def card_reports() -> list[dict[str, Any]]:
    """The card emulation's per-process peaks (DGSTREAM_CARD_REPORT), largest first."""
    folder = os.environ.get("DGSTREAM_CARD_REPORT")
    if not folder or not Path(folder).is_dir():
        return []
    out = []
    for f in Path(folder).glob("card-*.json"):
        with contextlib.suppress(OSError, ValueError):
            out.append(json.loads(f.read_text()))
    return sorted(out, key=lambda r: -r.get("peak_reserved_gib", 0))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quant", choices=["bf16", "nvfp4"], default="nvfp4")
    ap.add_argument(
        "--budget-gib",
        type=float,
        default=0.0,
        help="a share of the whole GPU for vLLM (0: the settings' gpu_memory_utilization)",
    )
    ap.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=None,
        help="of the (emulated) card, as in the settings (default: the settings')",
    )
    ap.add_argument("--read-path", choices=["dgstream", "stock"], default="dgstream")
    ap.add_argument(
        "--served-canvas", type=int, default=None, help="served canvas (default: settings')"
    )
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="vLLM resets >= 128 to 8")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--graphs", choices=["default", "budget"], default="budget")
    ap.add_argument("--unconstrained", action="store_true", help="full-vocabulary reads")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (faster start)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--moe-backend", default=None, help="vLLM's MoE kernels (e.g. marlin)")
    ap.add_argument("--linear-backend", default=None, help="vLLM's linear kernels")
    ap.add_argument(
        "--cudagraph-mode",
        choices=["FULL_AND_PIECEWISE", "FULL", "PIECEWISE", "NONE"],
        default=None,
        help="vLLM's CUDA graph mode (default: vLLM's own)",
    )
    ap.add_argument(
        "--full-graph-tokens",
        type=int,
        default=None,
        help="VllmSettings.full_graph_tokens: mixed steps up to this many tokens in FULL "
        "graphs (default: the settings' own)",
    )
    ap.add_argument(
        "--one-step-reads",
        nargs="?",
        const="true",
        default=None,
        choices=sorted(ONE_STEP_CHOICES),
        help="VllmSettings.one_step_reads (alone: true, every read that can in one step; "
        "default: the settings' own, auto)",
    )
    ap.add_argument(
        "--beside-two-step",
        action="store_true",
        help="with one-step reads: every row again with the reads opting out (two steps)",
    )
    ap.add_argument(
        "--in-flight",
        default="1",
        help="batches read at once, a comma list measured row by row (the worker keeps 2)",
    )
    ap.add_argument("--profile", default="", help="absolute dir for torch profiler traces")


def main(args: argparse.Namespace) -> int:
    if args.beside_two_step and args.one_step_reads == "false":
        # Without one-step reads every row already takes two steps: the pair would be twins.
        raise SystemExit("--beside-two-step needs one-step reads (not --one-step-reads false)")
    result = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return 0


# --- docs/benchmarks.md ------------------------------------------------------------------

# The figures of 2026-12-01 (the first vLLM run, before this benchmark existed; same
# shapes, vLLM's default scheduling with max_num_seqs 16), reads/s at batch 1/8/32/128/256.
EARLIER = {
    ("nvfp4", "unique"): [25, 39, 48, 60, 70],
    ("nvfp4", "shared"): [33, 122, 140, 134, 140],
    ("bf16", "unique"): [26, 58, 87, 81, 102],
}
TARGETS = (
    "at batch 256: >= 300 reads/s unique, >= 1,000 on one question set; p50 <= 25 ms at batch 1"
)
COMMAND = (
    "bash bench/gpu/vllm_session.sh nvfp4    # on the GPU machine (then bf16): "
    "bench/engine_gpu.py --engine vllm\n"
    "python bench/engine_gpu.py --render-vllm docs/data/engine_vllm_nvfp4.json "
    "docs/data/engine_vllm_bf16.json   # here: this section"
)


def _from_log(path: Path, info: dict[str, Any]) -> dict[str, Any]:
    """Weights and KV tokens from the run's log where the JSON lacks them."""
    log = path.with_suffix(".log")
    if log.exists() and (info.get("weights_gib") is None or info.get("kv_cache_tokens") is None):
        text = log.read_text(errors="replace")
        loaded = re.findall(r"Model loading took ([0-9.]+) GiB", text)
        kv = re.findall(r"GPU KV cache size: ([0-9,]+) tokens", text)
        info = {
            **info,
            "weights_gib": float(loaded[-1]) if loaded else None,
            "kv_cache_tokens": int(kv[-1].replace(",", "")) if kv else None,
        }
    return info


def render(paths: list[Path]) -> str:
    from bench.report import figure

    runs = []
    for p in paths:
        body = json.loads(p.read_text())
        runs.append((_from_log(p, body["info"]), body["rows"]))
    first = runs[0][0]["settings"]
    lines = [
        "## vLLM on one H200: the full-size DiffusionGemma shape, dummy weights",
        "",
        f"vLLM 0.33.0 (torch 2.14), `VllmEngine` in-process, `load_format=dummy` (random "
        f"weights of the published shape; no download). Reads as the transformers rows: "
        f"256-token prompts, a {first['canvas_length']}-token canvas, 3 answer slots, "
        f"constrained reads (`diffusion_constrained`); served canvas {first['canvas_length']}, "
        f"max_model_len {first['max_model_len']}, max_num_seqs {first['max_num_seqs']}, "
        f"max_num_batched_tokens {first['max_num_batched_tokens']}, {first['attention_backend']}, "
        "prefix caching, CUDA graphs. `unique`: prompts that share nothing (fresh each "
        "repeat); `shared`: one question set (a 224-token prefix common to all).",
        "",
        "| weights | budget (gpu_memory_utilization) | weights GiB | KV cache tokens "
        "| card peak GiB | engine start s |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for info, _ in runs:
        weights = figure(f"{info['quant']}_weights_gib", info["weights_gib"])
        lines.append(
            f"| {info['quant']} | {info['budget_gib']:.0f} GiB ({info['gpu_memory_utilization']}) "
            f"| {weights} "
            f"| {info['kv_cache_tokens']:,} | {info['peak_gib']:.1f} "
            f"| {info['start_s']:.0f} |"
        )
    head = "| batch |"
    rule = "|---:|"
    for info, _ in runs:
        for kind in ("unique", "shared"):
            head += f" {info['quant']} {kind}: reads/s (p50 / p99 ms) | earlier |"
            rule += "---:|---:|"
    lines += ["", head, rule]
    batches = sorted({r["batch"] for _, rows in runs for r in rows})
    for i, b in enumerate(batches):
        cells = [str(b)]
        for info, rows in runs:
            by = {r["variant"]: r for r in rows if r["batch"] == b}
            for kind in ("unique", "shared"):
                r = by.get(f"vllm/{kind}")
                cells.append(
                    f"{r['reads_per_s']:.1f} ({r['p50_ms']:.0f} / {r['p99_ms']:.0f})" if r else "-"
                )
                earlier = EARLIER.get((info["quant"], kind))
                cells.append(str(earlier[i]) if earlier and i < len(earlier) else "-")
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"These are the runs before tuning (vLLM lowered max_num_seqs to 8); the tuned runs "
        f"follow. Targets ({TARGETS}): see the notes below. `earlier`: the first vLLM run of "
        "2026-12-01 (same shapes, max_num_seqs 16).",
        "",
        "Reproduce:",
        "",
        "```",
        COMMAND,
        "```",
    ]
    return "\n".join(lines)


def render_tests(path: Path, bf16_path: Path | None = None) -> str:
    """The GPU tier's figures (the gpu tests write them to $DGSTREAM_GPU_OUT/gpu_tests.json)."""
    from bench.report import figure

    r = json.loads(path.read_text())
    hf = r["transformers"]
    lines = [
        "## vLLM against the transformers engine on the GPU: the demo model (the gpu tests)",
        "",
        f"{hf['requests']} held-out demo requests through `Classifier`, the same canvases "
        "(noise seeds) for every engine, both engines in fp32 on one H200. Pass: every answer "
        "the same, every probability within 0.01, vLLM's answers over the demo model's bar.",
        "",
        "| engine | questions | answers that differ | largest probability gap | accuracy "
        "yes/no / choice / score | ECE | requests/s |",
        "|---|---:|---:|---:|---|---:|---:|",
        f"| transformers (CUDA) | - | - | - | - | - | {hf['requests'] / hf['seconds']:.0f} |",
    ]
    for key, name in (
        ("vllm_constrained", "VllmEngine, constrained"),
        ("vllm_full_vocabulary", "VllmEngine, full vocabulary"),
        ("vllm_remote", "`vllm serve` over HTTP (against in-process)"),
    ):
        v = r[key]
        acc = v.get("accuracy")
        accuracy = (
            " / ".join(f"{acc[k]:.3f}" for k in ("yes_no", "choice", "score")) if acc else "-"
        )
        ece = f"{v['ece']:.4f}" if "ece" in v else "-"
        gap = f"{v['max_probability_gap']:.4f}"
        lines.append(
            f"| {name} | {v['questions']} | {v['answers_differ']} | "
            f"{figure(f'{key}_gap', gap)} | {accuracy} | {ece} | "
            f"{v['requests'] / v['seconds']:.0f} |"
        )
    lines += [
        "",
        f"Engine start: in-process {r['vllm_start_s']:.0f} s, `vllm serve` "
        f"{r['serve_start_s']:.0f} s (eager: the demo model is tiny).",
    ]
    if bf16_path is not None and bf16_path.exists():
        b = json.loads(bf16_path.read_text())["vllm_constrained"]
        lines += [
            "",
            f"In bf16 (the production dtype) the same run gave {b['answers_differ']} different "
            f"answers of {b['questions']} and a largest probability gap of "
            f"{b['max_probability_gap']:.3f}: over the 0.01 bar, so the test compares in fp32.",
        ]
    lines += [
        "",
        "The requests/s column is the demo model (3.6 M parameters): vLLM's cost there is its "
        "per-read overhead, not the model.",
        "",
        "Reproduce (GPU machine; `docs/data/gpu_tests.json`):",
        "",
        "```",
        "bash bench/gpu/vllm_session.sh tests",
        "python bench/engine_gpu.py --render-gpu-tests docs/data/gpu_tests.json",
        "```",
    ]
    return "\n".join(lines)


# --- docs/benchmarks.md: the tuning runs ------------------------------------------------------

TUNING_COMMAND = (
    "bash bench/gpu/vllm_session.sh nvfp4     # on the GPU machine; then, one engine start each:\n"
    "python3 bench/engine_gpu.py --engine vllm --quant nvfp4 --budget-gib 23 "
    "--async-scheduling --max-num-batched-tokens 8192 --out nvfp4_async_8192.json\n"
    "python3 bench/engine_gpu.py --engine vllm --quant nvfp4 --budget-gib 23 "
    "--no-async-scheduling --max-num-batched-tokens {8192,4096,16384} --out nvfp4_sync_N.json\n"
    "python bench/engine_gpu.py --render-tuning docs/data/engine_vllm_nvfp4.json "
    "docs/data/vllm_tuning/nvfp4_*.json   # here: this section"
)


def _variant(info: dict[str, Any]) -> str:
    s = info["settings"]
    sched = scheduling_name(s)
    graphs = "vLLM's graphs" if s["cudagraph_capture_sizes"] is None else "graphs to budget"
    return f"{s['max_num_seqs']} seqs, {s['max_num_batched_tokens']} tokens, {sched}, {graphs}"


def render_tuning(paths: list[Path]) -> str:
    """One row per engine configuration: the same reads, NVFP4 at one budget, one session."""
    from bench.report import figure

    lines = [
        "## vLLM tuning at the 24 GB budget: NVFP4, one H200 (2026-12-01)",
        "",
        "The engine benchmark's reads (256-token prompts, a 16-token canvas, 3 slots, "
        "constrained) on the full-size shape in NVFP4 with dummy weights, in 23 GiB "
        "(gpu_memory_utilization 0.1638), one engine start per row. `before`: the first run "
        "(vLLM lowered its max_num_seqs to 8). reads/s at batch 256 and p50 ms at batch 1.",
        "",
        "| engine settings | KV cache tokens | start s | unique b256 reads/s | shared b256 "
        "reads/s | best shared reads/s (batch) | unique b1 p50 ms | shared b1 p50 ms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    b256: dict[str, tuple[float, float]] = {}  # "before" / "defaults" -> unique, shared
    for p in paths:
        body = json.loads(p.read_text())
        info = _from_log(p, body["info"])
        rows = {(r["variant"], r["batch"]): r for r in body["rows"]}
        shared = [r for r in body["rows"] if r["variant"] == "vllm/shared"]
        best = max(shared, key=lambda r: r["reads_per_s"])
        label = _variant(info) if "vllm_tuning" in str(p) else "before: 8 seqs (lowered)"
        unique = f"{rows[('vllm/unique', 256)]['reads_per_s']:.0f}"
        one_set = f"{rows[('vllm/shared', 256)]['reads_per_s']:.0f}"
        if "vllm_tuning" not in str(p):
            b256["before"] = (float(unique), float(one_set))
        if _is_default(info["settings"]):
            label = f"**{label}** (the defaults)"
            b256["defaults"] = (float(unique), float(one_set))
            unique = figure("defaults_unique_b256", unique)
            one_set = figure("defaults_shared_b256", one_set)
        lines.append(
            f"| {label} | {info['kv_cache_tokens']:,} | {info['start_s']:.0f} "
            f"| {unique} | {one_set} "
            f"| {best['reads_per_s']:.0f} ({best['batch']}) "
            f"| {rows[('vllm/unique', 1)]['p50_ms']:.1f} "
            f"| {rows[('vllm/shared', 1)]['p50_ms']:.1f} |"
        )
    lines += [
        "| 127 seqs, 16384 tokens, sync, graphs to budget | - | refused | - | - | - | - | - |",
    ]
    if "before" in b256 and "defaults" in b256:
        (u0, s0), (u1, s1) = b256["before"], b256["defaults"]
        lines += [
            "",
            "The defaults against the run before tuning, at batch 256: "
            f"x{figure('speedup_unique', f'{u1 / u0:.1f}')} on unique prompts, "
            f"x{figure('speedup_shared', f'{s1 / s0:.1f}')} on one question set.",
        ]
    lines += [
        "",
        *_per_batch(paths),
        "",
        "16384 tokens: vLLM refused to start (`nvfp4_sync_16384_refused.log`): the larger "
        "step's activations left 3.02 GiB of KV cache, under the 3.44 GiB one 16,384-token "
        "request needs. Logs and JSON: `docs/data/vllm_tuning/`.",
        "",
        "Reproduce:",
        "",
        "```",
        TUNING_COMMAND,
        "```",
    ]
    return "\n".join(lines)


def _per_batch(paths: list[Path]) -> list[str]:
    """Every batch size of the tuned runs: reads/s (p50 / p99 ms), unique and shared."""
    runs = [json.loads(p.read_text()) for p in paths if "vllm_tuning" in str(p)]
    head, rule = "| batch |", "|---:|"
    for r in runs:
        s = r["info"]["settings"]
        sched = "sync" if s["async_scheduling"] is False else "async"
        name = f"{s['max_num_batched_tokens']} {sched}"
        head += f" {name} unique | {name} shared |"
        rule += "---:|---:|"
    out = [head, rule]
    for b in sorted({row["batch"] for r in runs for row in r["rows"]}):
        cells = [str(b)]
        for r in runs:
            by = {row["variant"]: row for row in r["rows"] if row["batch"] == b}
            for kind in ("unique", "shared"):
                x = by[f"vllm/{kind}"]
                cells.append(f"{x['reads_per_s']:.0f} ({x['p50_ms']:.0f} / {x['p99_ms']:.0f})")
        out.append("| " + " | ".join(cells) + " |")
    return out


# The scheduling defaults these runs chose (2026-12-01). VllmSettings' own moved on since
# (256 reads in flight with the read path, async scheduling with it: the card sections), so
# the section compares with what was chosen here, and re-renders the same.
TUNED_DEFAULTS = {"max_num_seqs": 127, "max_num_batched_tokens": 4096, "async_scheduling": False}


def _is_default(settings: dict[str, Any]) -> bool:
    """Whether a run used the scheduling defaults chosen from these runs."""
    return all(settings[k] == v for k, v in TUNED_DEFAULTS.items())


# --- docs/benchmarks.md: the emulated 24 GB card -------------------------------------------

CARD_COMMAND = (
    "bash bench/gpu/vllm_session.sh tests   # on the GPU machine, one device session:\n"
    "bash bench/gpu/vllm_session.sh card dgstream\n"
    "bash bench/gpu/vllm_session.sh card stock --read-path stock --served-canvas 16 "
    "--max-model-len 4096\n"
    "bash bench/gpu/peer_session.sh --max-model-len 4096\n"
    "python bench/engine_gpu.py --render-card docs/data/card24/card_dgstream.json "
    "docs/data/card24/card_stock.json docs/data/card24/gpu_tests.json   # here\n"
    "python bench/peer_decisions.py --render docs/data/card24/peer_decisions.json --beside "
    '"read path (dgstream defaults)=docs/data/card24/card_dgstream.json" --beside '
    '"stock in-process=docs/data/card24/card_stock.json" --write'
)
# The targets set for the emulated card (full-size NVFP4, the default settings).
CARD_TARGETS = {"shared": 1000.0, "unique": 300.0, "p50_b1_ms": 25.0}


def _card_memory(info: dict[str, Any]) -> str:
    from bench.report import figure

    s = info["settings"]
    proc = info["process_peaks"][0] if info.get("process_peaks") else {}
    path = info["read_path"]

    def fig(key: str, value: str) -> str:  # the figures other pages quote, per read path
        return figure(f"{path}_{key}", value)

    serving, start = (
        fig("peak_serving_gib", f"{info['peak_gib']:.1f}"),
        fig("peak_start_gib", f"{info['start_peak_gib']:.1f}"),
    )
    allocator = fig("allocator_peak_gib", f"{proc.get('peak_reserved_gib', 0):.2f}")
    cap = fig("allocator_cap_gib", f"{proc.get('allocator_cap_gib', 0):.2f}")
    return (
        f"| {path} | {info['engine_gpu_memory_utilization']} "
        f"| {s['canvas_length']} / {info.get('max_model_len_used') or _resolved_len(s):,} "
        f"| {info['max_num_seqs_used']} "
        f"| {fig('weights_gib', str(info['weights_gib']))} | {info['kv_cache_tokens']:,} "
        f"| {serving} | {start} | {allocator} of {cap} "
        f"| {info['start_s']:.0f} |"
    )


def _resolved_len(settings: dict[str, Any]) -> int:
    """max_model_len as `check_model` resolves it for the full-size shape (its 262,144
    positions are above the reference 16,384), for runs that did not record it."""
    from dgstream.workers.engine.vllm.sizing import REFERENCE_MAX_MODEL_LEN

    return int(settings["max_model_len"] or REFERENCE_MAX_MODEL_LEN)


def render_card(read_path: Path, stock: Path, gpu_tests: Path) -> str:
    """Both read paths on the emulated card, side by side, and the demo model's agreement."""
    from bench.report import figure

    ours, theirs = json.loads(read_path.read_text()), json.loads(stock.read_text())
    tests = json.loads(gpu_tests.read_text())
    o_rows = {(r["variant"], r["batch"]): r for r in ours["rows"]}
    t_rows = {(r["variant"], r["batch"]): r for r in theirs["rows"]}
    lines = [
        "## A 24 GB card for real: the read path and vLLM's own, on an emulated card",
        "",
        f"One H200 made to behave as a {ours['info']['card_gib']} GiB card in every process "
        "(`bench/gpu/card/sitecustomize.py`: PyTorch's allocator capped at the card less a "
        "CUDA context, and the memory queries vLLM sizes itself from reporting the card), "
        "vLLM 0.33.0, the full-size DiffusionGemma shape in NVFP4 with dummy weights, "
        "`VllmEngine` in-process. Reads as the engine benchmark's: 256-token prompts, "
        "16-position canvases with 3 slots, constrained; `shared` is one question set (a "
        "224-token common prefix). One device session (2026-12-02).",
        "",
        "**Memory.** The read path runs the product's defaults; vLLM's own path (`read_path: "
        "stock`) cannot: its first denoise step is outside vLLM's profile, the settings take "
        "it off gpu_memory_utilization, and at the defaults' 64-position served canvas that "
        "step is 5.9 GiB. With a 16-position canvas it starts, but its KV cache holds 4,609 "
        "tokens: max_model_len 8192 was refused (`card_stock_8192_refused.log`: 1.14 GiB "
        "needed, 0.97 available).",
        "",
        "| read path | gpu_memory_utilization given to vLLM | served canvas / max_model_len "
        "| reads in flight | weights GiB | KV cache tokens | card peak serving GiB | card peak "
        "at start GiB | engine process: allocator peak of cap GiB | start s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        _card_memory(ours["info"]),
        _card_memory(theirs["info"]),
        "",
        "Card peaks are NVML's (every process on the GPU, the CUDA context included); the "
        "allocator's peak is PyTorch's own, in the engine process, under its cap.",
        "",
        "**Reads/s (p50 / p99 ms)**, the same reads through both paths, one after the other:",
        "",
        "| batch | kind | read path (defaults) | stock | read path / stock |",
        "|---:|---|---:|---:|---:|",
    ]
    big = max(r["batch"] for r in ours["rows"])
    for b in sorted({r["batch"] for r in ours["rows"]}):
        for kind in ("unique", "shared"):
            a, z = o_rows[(f"vllm/{kind}", b)], t_rows[(f"vllm/{kind}", b)]
            ours_rate, ratio = (
                f"{a['reads_per_s']:.1f}",
                f"{a['reads_per_s'] / z['reads_per_s']:.2f}",
            )
            if b == big:  # the figures other pages quote
                ours_rate = figure(f"{kind}_b{b}", ours_rate)
                ratio = figure(f"vs_stock_{kind}_b{b}", ratio)
            lines.append(
                f"| {b} | {kind} | {ours_rate} ({a['p50_ms']:.0f} / "
                f"{a['p99_ms']:.0f}) | {z['reads_per_s']:.1f} ({z['p50_ms']:.0f} / "
                f"{z['p99_ms']:.0f}) | {ratio}x |"
            )
    shared, unique = o_rows[("vllm/shared", big)], o_rows[("vllm/unique", big)]
    p50 = min(o_rows[("vllm/shared", 1)]["p50_ms"], o_rows[("vllm/unique", 1)]["p50_ms"])
    lines += [
        "",
        f"Targets at batch {big}: >= {CARD_TARGETS['shared']:,.0f} reads/s on one "
        f"question set: **{shared['reads_per_s']:.0f}**; >= {CARD_TARGETS['unique']:.0f} on "
        f"unique prompts: **{unique['reads_per_s']:.0f}**; p50 <= "
        f"{CARD_TARGETS['p50_b1_ms']:.0f} ms at batch 1: **{p50:.0f}**. None is met; where "
        "the time goes is in the notes below.",
        "",
        "**The same answers** (the gpu tests, the demo model on the bare H200, fp32, 300 "
        "held-out requests through `Classifier`, the same canvases):",
        "",
        "| compared | questions | answers that differ | largest probability gap "
        "| seconds (read path / other) |",
        "|---|---:|---:|---:|---:|",
    ]
    for key, name in (
        ("read_path_vs_stock_constrained", "read path vs stock vLLM, constrained"),
        ("read_path_vs_stock_full_vocabulary", "read path vs stock vLLM, full vocabulary"),
    ):
        v = tests[key]
        lines.append(
            f"| {name} | {v['questions']} | {v['answers_differ']} | "
            f"{v['max_probability_gap']:.6f} | {v['seconds']:.2f} / {v['stock_seconds']:.2f} |"
        )
    for key, name in (
        ("vllm_constrained", "read path vs transformers, constrained"),
        ("vllm_full_vocabulary", "read path vs transformers, full vocabulary"),
        ("vllm_remote", "`vllm serve` with the read path vs in-process"),
    ):
        v = tests[key]
        gap = figure(f"{key}_gap", f"{v['max_probability_gap']:.6f}")
        lines.append(f"| {name} | {v['questions']} | {v['answers_differ']} | {gap} | - |")
    lines += ["", "Reproduce:", "", "```", CARD_COMMAND, "```"]
    return "\n".join(lines)

"""A soak of the read path on the emulated card: many full-size reads, every read's label
logprobs kept, every failed batch counted, in phases.

Run on the GPU machine (bench/gpu/vllm_session.sh soak|diag), one engine per process: the
full-size NVFP4 shape with dummy weights and the product's defaults, on the 23.6 GiB card,
at whatever SM share the process was started with (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE).

- The workload is a fixed function of `--seed`: batches of 1 to 256 reads (`--sizes`), unique
  prompts and one of four question sets (shared 224-token prefixes) in turn, `--in-flight`
  batches at once (the worker keeps 2). Each read has a tag (its index), so two runs (full
  speed and a limited share) can be compared read by read (`soak_compare.py`).
- `--phases NAME:BATCHES[:FLAGS],...` runs the workload in phases; FLAGS (`+`-joined) are
  files made in DGSTREAM_READS_DEBUG_DIR for the phase (`sync`: see
  workers/engine/vllm_reads/debug.py), so one engine serves with and without a switch.
- `--repeat N`: at the end, the first N reads again in other batches (64 a batch, one in
  flight): how far the same read moves with its batch on the same engine (vLLM is not
  batch-invariant), the floor of any read-by-read tolerance.

Every read's raw label logprobs are taken from vLLM's output before the read path's own
checks run, so a read that fails them is kept too, with what it held.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.harness.vllm_soak import SIZES, Recorder, parse_phases, workload

STARTED = time.monotonic()


def set_flags(debug_dir: str, flags: tuple[str, ...]) -> None:
    os.makedirs(debug_dir, exist_ok=True)
    for name in os.listdir(debug_dir):
        os.unlink(os.path.join(debug_dir, name))
    for name in flags:
        Path(debug_dir, name).touch()


async def run_batches(
    engine: Any, batches: list[list[Any]], depth: int, errors: list[dict[str, Any]]
) -> None:
    slots = asyncio.Semaphore(depth)

    async def one(reads: list[Any]) -> None:
        async with slots:
            try:
                await engine.read(reads)
            except Exception as exc:  # counted, and the soak goes on
                errors.append(
                    {
                        "first": reads[0].tag,
                        "size": len(reads),
                        "error": f"{type(exc).__name__}: {exc}"[:400],
                        "time": time.time(),
                    }
                )
                print(f"# batch {reads[0].tag}+{len(reads)}: {exc!r}", flush=True)

    await asyncio.gather(*(one(b) for b in batches))


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    from bench.engine_vllm import SHARED_LABELS, full_size_dir, stable_root
    from dgstream.workers.engine.vllm.engine import VllmEngine
    from dgstream.workers.engine.vllm.settings import VllmSettings

    knobs = json.loads(args.settings or "{}")
    if args.model == "full-size":
        root = stable_root()  # one path on every start: the compile cache hits
        settings = VllmSettings(
            model=str(full_size_dir("nvfp4", root)),
            load_format="dummy",
            skip_tokenizer_init=True,
            **knobs,
        )
    else:
        # A small model with real weights: its reads differ from prompt to prompt far more
        # than the dummy weights' do, so a read answered with another's values shows.
        from dgstream.workers.engine.models import TRAINED_DIRS

        model = TRAINED_DIRS["demo"].parent / args.model
        settings = VllmSettings(model=str(model), skip_tokenizer_init=True, **knobs)
    engine = VllmEngine(settings, shared_labels=SHARED_LABELS)
    recorder = Recorder()
    recorder.install()
    t0 = time.perf_counter()
    await engine.start()
    start_s = time.perf_counter() - t0
    print(f"# engine started in {start_s:.1f} s", flush=True)
    vocab = engine.info.vocab_size
    if args.model != "full-size":
        # The demo's image and image-boundary ids sit at the top of its 2,048 ids: a prompt
        # holding one would be a multimodal prompt without its image.
        config = json.loads((Path(settings.model) / "config.json").read_text())
        vocab = min(vocab, *(config[k] for k in ("boi_token_id", "eoi_token_id", "image_token_id")))
    sizes = tuple(int(x) for x in args.sizes.split(","))
    batches = workload(args.seed, args.reads, sizes, vocab)
    phases = parse_phases(args.phases) if args.phases else [("all", 0, ())]
    debug_dir = os.environ.get("DGSTREAM_READS_DEBUG_DIR", "")
    results = []
    at = 0
    # From the process's start: a device call's limit counts the engine's start too.
    deadline = STARTED + args.budget_s if args.budget_s else None
    for name, count, flags in phases:
        if deadline is not None and time.monotonic() > deadline:
            print(f"# phase {name}: skipped, over --budget-s", flush=True)
            break
        if flags and not debug_dir:
            raise SystemExit("--phases with flags needs DGSTREAM_READS_DEBUG_DIR")
        if debug_dir:
            set_flags(debug_dir, flags)
        chunk = batches[at : at + count] if count else batches[at:]
        at += len(chunk)
        errors: list[dict[str, Any]] = []
        t = time.perf_counter()
        # In pieces, so a phase can stop at the budget without losing what it read.
        for i in range(0, len(chunk), 8):
            await run_batches(engine, chunk[i : i + 8], args.in_flight, errors)
            if deadline is not None and time.monotonic() > deadline:
                chunk = chunk[: i + 8]
                print(f"# phase {name}: stopped at the budget", flush=True)
                break
        seconds = time.perf_counter() - t
        n = sum(len(b) for b in chunk)
        row = {
            "phase": name,
            "flags": list(flags),
            "batches": len(chunk),
            "reads": n,
            "failed_batches": len(errors),
            "failed_reads": sum(e["size"] for e in errors),
            "seconds": seconds,
            "reads_per_s": n / seconds if seconds else None,
            "errors": errors[:50],
        }
        results.append(row)
        print(
            f"# phase {name} {'+'.join(flags) or '-'}: {len(chunk)} batches, {n} reads, "
            f"{len(errors)} failed batches, {n / seconds:.1f} reads/s",
            flush=True,
        )
        if args.out:  # what is read so far survives a call that runs out of time
            Path(args.out).write_text(
                json.dumps({"phases": results, "reads": recorder.reads, "partial": True})
            )
    repeat: dict[str, list[list[Any]]] = {}
    if args.repeat:
        if debug_dir:
            set_flags(debug_dir, ())
        first = [r for b in batches for r in b][: args.repeat]
        # The recorder keeps the last value per tag: keep the first pass's aside.
        kept = {r.tag: recorder.reads.get(r.tag) for r in first}
        errors = []
        await run_batches(engine, [first[i : i + 64] for i in range(0, len(first), 64)], 1, errors)
        repeat = {r.tag: recorder.reads.get(r.tag) for r in first}
        recorder.reads.update({k: v for k, v in kept.items() if v is not None})
        print(f"# repeat: {len(first)} reads again, {len(errors)} failed batches", flush=True)
    await engine.close()
    return {
        "info": {
            "name": args.name,
            "model": args.model,
            "seed": args.seed,
            "mps_active_thread_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
            "card_gib": os.environ.get("DGSTREAM_CARD_GIB"),
            "humming_sms": os.environ.get("DGSTREAM_DEBUG_HUMMING_SMS"),
            "start_s": start_s,
            "in_flight": args.in_flight,
            "sizes": list(sizes),
            "read_path": engine.read_path,
            "settings": json.loads(args.settings or "{}"),
        },
        "phases": results,
        "reads": recorder.reads,
        "repeat": repeat,
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--name", required=True)
    ap.add_argument("--out", required=True, help="JSON file")
    ap.add_argument(
        "--model",
        default="full-size",
        choices=("full-size", "demo", "demo-nvfp4"),
        help="the full-size NVFP4 shape (dummy weights) or a committed demo checkpoint",
    )
    ap.add_argument("--reads", type=int, default=10_000)
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--in-flight", type=int, default=2)
    ap.add_argument("--phases", default="")
    ap.add_argument("--repeat", type=int, default=0)
    ap.add_argument("--settings", default="", help="VllmSettings fields over the defaults, JSON")
    ap.add_argument(
        "--budget-s", type=float, default=0.0, help="no new batches this long after the start"
    )
    args = ap.parse_args()
    result = asyncio.run(main_async(args))
    Path(args.out).write_text(json.dumps(result))
    failed = sum(p["failed_batches"] for p in result["phases"])
    print(f"# {args.name}: {failed} failed batches in {len(result['phases'])} phases", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

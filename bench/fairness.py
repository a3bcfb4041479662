"""Fairness across partitions: how long a request on a quiet partition waits behind a flood
on another, with the worker's fairness turns (`workers.stream.intake.FAIR_TURN_BATCHES`)
and without them, side by side in one run.

A stream worker (on a thread of this process, the fake engine at zero cost; batches of 64,
two in flight, as tests/workers/test_fairness.py) reads a two-partition topic from a local
broker. Partition 0 holds a flood of one-byte records (each a dead letter; written before
the worker starts, in large zstd batches as librdkafka makes them). Once the flood is under
way, one request goes to partition 1. Reported per variant, as the median over the runs:
the request's wait (from its own timestamp to its answer's), the flood records answered
meanwhile, and the flood's rate (dead letters a second, the whole flood). Without turns the
worker is the one kafka-python gives: one partition's fetched records until they run out.

    .venv/bin/python bench/fairness.py                   # starts and stops its own broker
    .venv/bin/python bench/fairness.py --flood 10000 --repeat 1 --no-write   # a quick look

Prints the figures and the command; writes the "fairness" section of docs/benchmarks.md
(`--no-write` to skip).
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import dgstream.workers.stream.intake as intake
from bench.harness.pipeline import Pipeline, WorkerThread, request_bytes
from bench.report import figure, write_section
from dgstream.workers.kafka.admin import ensure_topics
from dgstream.workers.kafka.settings import KafkaConnection

# As tests/workers/test_fairness.py: the batch and the slots the bound there is stated for.
MAX_RECORDS = 64
IN_FLIGHT = 2
# Turns off: no partition ever fills this many batches in a row.
NEVER = 10**12
# A run gives up after this long without the answer or the whole flood.
RUN_TIMEOUT_S = 600.0


def run_once(boot: str, flood: int, fair: bool) -> dict[str, Any]:
    conn = KafkaConnection(bootstrap_servers=[boot])
    tag = uuid.uuid4().hex[:8]
    p = Pipeline(conn, f"fair-in-{tag}", f"fair-out-{tag}", f"fair-dlq-{tag}", f"fair-g-{tag}")
    ensure_topics(conn, {p.input: 2, p.output: 1, p.dead: 1})
    p.flood(flood)
    intake.FAIR_TURN_BATCHES = 1 if fair else NEVER
    settings = p.settings(
        batching={"max_records": MAX_RECORDS, "max_wait_ms": 20, "max_in_flight": IN_FLIGHT},
        log_level="WARNING",  # not a line per dead letter
    )
    worker = WorkerThread(settings).start()
    try:
        dead, out = p.reader(p.dead), p.reader()
        dead.read_until(lambda r: len(r.records) >= 2 * MAX_RECORDS, 120, "the flood under way")
        (meta,) = p.produce([request_bytes("urgent", 1)], keys=[b"urgent"], partition=1)
        out.read_until(lambda r: any(x.key == b"urgent" for x in r.records), RUN_TIMEOUT_S, "")
        answer = next(x for x in out.records if x.key == b"urgent")
        dead.read_until(lambda r: len(r.records) >= flood, RUN_TIMEOUT_S, "the whole flood")
        stamps = [x.timestamp for x in dead.records]
        between = sum(1 for t in stamps if meta.timestamp < t <= answer.timestamp)
        span_s = max((max(stamps) - min(stamps)) / 1000, 1e-3)
        return {
            "wait_s": (answer.timestamp - meta.timestamp) / 1000,
            "between": between,
            "rate": len(stamps) / span_s,
        }
    finally:
        worker.worker.drain(30)
        worker.join()
        for r in p.readers:
            r.close()
        intake.FAIR_TURN_BATCHES = 1


def render(runs: dict[str, list[dict[str, Any]]], args: argparse.Namespace, load: float) -> str:
    med = {
        v: {k: statistics.median(r[k] for r in rs) for k in ("wait_s", "between", "rate")}
        for v, rs in runs.items()
    }
    fair, unfair = med["turns"], med["no turns"]
    ratio = unfair["wait_s"] / max(fair["wait_s"], 1e-3)
    rate_ratio = fair["rate"] / max(unfair["rate"], 1e-3)
    shown = figure("fairness_wait_ratio", f"{ratio:.1f}")
    rows = [
        f"| {v} | {m['wait_s']:.2f} | {m['between']:,.0f} | {m['rate']:,.0f} | "
        + ", ".join(f"{r['wait_s']:.2f}" for r in runs[v])
        + " |"
        for v, m in med.items()
    ]
    return "\n".join(
        [
            "## Fairness: a request behind another partition's flood",
            "",
            f"{time.strftime('%Y-%m-%d')}, {platform.machine()} with {os.cpu_count()} cores "
            f"(load {load:.1f} at the start), one local broker; a flood of {args.flood:,} "
            f"one-byte records on partition 0, one request on partition 1 once the flood is "
            f"under way; batches of {MAX_RECORDS}, {IN_FLIGHT} in flight, the fake engine; "
            f"{args.repeat} run(s) a variant, alternating. Medians:",
            "",
            "| worker | request's wait (s) | flood records answered meanwhile | "
            "flood rate (letters/s) | each run's wait (s) |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"Without turns the request waited **{shown}x** "
            f"as long; the flood's own rate with turns was {rate_ratio:.2f}x its rate without. "
            "A turn costs the flood one poll without it each batch while another partition "
            "is held back, and a partition counts as held back while no fetch of it is under "
            "way (kafka-python sends none while the flood's response is in line), even when it "
            "turns out to hold nothing: with one-byte records and an engine that costs nothing "
            "(this run) that poll is a visible share of a batch; a model's batch takes far "
            "longer than a loopback fetch. The bound the tests hold "
            "(tests/workers/test_fairness.py) is in records, not seconds.",
            "",
            f"Reproduce: `{command(args)}` (starts and stops its own broker).",
        ]
    )


def command(args: argparse.Namespace) -> str:
    parts = ["python bench/fairness.py"]
    if args.flood != 50_000:
        parts.append(f"--flood {args.flood}")
    if args.repeat != 2:
        parts.append(f"--repeat {args.repeat}")
    return " ".join(parts)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bootstrap", help="an existing broker (default: start a local one)")
    ap.add_argument("--flood", type=int, default=50_000, help="records in the flood")
    ap.add_argument("--repeat", type=int, default=2, help="runs of each variant")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    args = ap.parse_args(argv)
    load = os.getloadavg()[0]

    from bench.worker_overhead import broker_at

    runs: dict[str, list[dict[str, Any]]] = {"turns": [], "no turns": []}
    with broker_at(args.bootstrap) as boot:
        for i in range(args.repeat):
            for variant in ("turns", "no turns") if i % 2 == 0 else ("no turns", "turns"):
                got = run_once(boot, args.flood, variant == "turns")
                print(f"{variant}: {got}", flush=True)
                runs[variant].append(got)
    md = render(runs, args, load)
    print()
    print(md)
    if not args.no_write:
        write_section("fairness", md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

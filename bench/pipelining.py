"""Pipelining: the stream worker with one batch in flight against two, same broker, same messages.

A GPU engine waits on the card, so the worker's second batch in flight is what keeps the
card busy while the first one's results are sent and committed. This measures it on the CPU
with the fake engine at a fixed cost per read (`--cost-ms`, an `asyncio.sleep`: it waits as
a GPU read does, without taking the CPU), batches of `--max-records`, at-least-once:

- `1 in flight`: `batching.max_in_flight = 1` (the next batch waits for the last one);
- `2 in flight`: the default.

Both variants read the same input topic from its beginning, alternating, `--repeat` times.
Rate = results per second between the first and the last output record's timestamp (the
engine build and the group join count for none); the best run of each is reported, and the
ratio 2 / 1 is the overlap (about 2.0: the engine's cost fully hidden; a little above 2 is
the rate's measuring span, not more than full overlap).

    .venv/bin/python bench/pipelining.py            # starts and stops its own broker
    .venv/bin/python bench/pipelining.py --write    # also rewrites its docs/benchmarks.md section
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import write_section
from bench.worker_overhead import (
    PARTITIONS,
    broker_at,
    make_messages,
    measured,
    produce_input,
    run_worker,
)
from dgstream.workers.engine.factory import EngineSettings, build_classifier
from dgstream.workers.hosting.logs import configure_logging
from dgstream.workers.kafka.admin import ensure_topics
from dgstream.workers.kafka.settings import KafkaConnection


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bootstrap", help="an existing broker (default: start a local one)")
    ap.add_argument("--messages", type=int, default=2_000)
    ap.add_argument("--max-records", type=int, default=256)
    # 4 ms a read: a 256-read batch takes about 1 s, the order of the GPU pipeline run's
    # batches (the demo model on vLLM: 256 reads in about 1.5 s).
    ap.add_argument("--cost-ms", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--write", action="store_true", help="rewrite docs/benchmarks.md's section")
    args = ap.parse_args(argv)
    configure_logging("WARNING")
    load = os.getloadavg()[0]
    engine = EngineSettings(backend="fake", fake_cost_per_read_s=args.cost_ms / 1000)

    rates: dict[int, list[float]] = {1: [], 2: []}
    with broker_at(args.bootstrap) as bootstrap:
        conn = KafkaConnection(bootstrap_servers=bootstrap)
        topic = f"bench-pipe-in-{uuid.uuid4().hex[:8]}"
        ensure_topics(conn, {topic: PARTITIONS})
        produce_input(conn, topic, make_messages(args.messages))
        classifier = build_classifier(engine, {}, "bench")
        for rep in range(args.repeat):
            for in_flight in (1, 2):
                batching = {"max_records": args.max_records, "max_in_flight": in_flight}

                def run(out: str, batching: dict[str, int] = batching) -> Any:
                    return run_worker(conn, topic, out, args.messages, classifier, batching)

                label = f"run {rep + 1}, {in_flight} in flight"
                rates[in_flight].append(measured(conn, args.messages, label, run))

    best = {k: max(v) for k, v in rates.items()}
    ratio = best[2] / best[1]
    command = "python bench/pipelining.py --write"
    runs = "; ".join(
        f"{k} in flight {' / '.join(f'{r:,.0f}' for r in v)}" for k, v in rates.items()
    )
    md = "\n".join(
        [
            "## Pipelining: two batches in flight against one",
            "",
            f"Local single-node Kafka broker (loopback), {os.cpu_count()} CPU cores "
            f"({platform.machine()}), Python {platform.python_version()}. {args.messages:,} "
            f"requests (two inline questions, one read each) on {PARTITIONS} partitions; the "
            f"stream worker at-least-once, batches of {args.max_records}; the fake engine "
            f"waits {args.cost_ms:g} ms a read (a GPU-like wait that leaves the CPU free). "
            f"Best of {args.repeat} alternating runs (all runs: {runs}). Load average "
            f"{load:.1f} at the start.",
            "",
            "| variant | results/s |",
            "|---|---:|",
            f"| 1 batch in flight | {best[1]:,.0f} |",
            f"| 2 batches in flight (the default) | {best[2]:,.0f} |",
            "",
            f"Ratio 2 / 1: **{ratio:.2f}** (about 2: the engine's wait hidden entirely). "
            "What the ratio measures: whether the worker hands the engine its next batch "
            "while the last one's results are still being sent and committed.",
            "",
            f"Reproduce: `{command}` (starts and stops its own broker).",
        ]
    )
    print()
    print(md)
    if args.write:
        write_section("worker-pipelining", md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

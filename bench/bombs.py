"""Compression bombs against a real worker: its memory, and how soon good traffic goes on.

A stream worker (a process of its own, the fake engine, every setting at its default:
consumer.max_batch_bytes unset, so 32 x max_message_bytes = 32 MiB) reads a one-partition
topic from a local broker. Each case sends bombs (librdkafka, `bench/harness/bombs.py`: a
value of hundreds of MB that its codec makes KBs) and then one good request, to that
partition, each in a batch of its own. While it runs, the worker process's RSS is sampled
every 10 ms (psutil). Reported per case: the peak RSS over the RSS just before the case,
the code each bomb was dead-lettered with, how long after the last bomb was written its
dead letter appeared, and how long after the good request was written its answer
appeared on the output topic (the first row: a good request alone).

    .venv/bin/python bench/bombs.py              # starts and stops its own broker
    .venv/bin/python bench/bombs.py --bootstrap 127.0.0.1:9092 --cases zstd-json,gzip-byte

Then the cases of COMPARED again, against a worker without the consumer's bound
(kafka-python decompressing each batch whole), for comparison (`--no-compare` skips them).
Prints the figures and the command; writes the "bombs" section of docs/benchmarks.md
(`--no-write` to skip). `--scale 0.05` shrinks every bomb and the bound alike (a quick
check of the script, not a figure: nothing is written).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


import psutil
from kafka import KafkaConsumer, TopicPartition

from bench.harness.bombs import Producers, Send, byte_bomb, json_bomb
from bench.report import figure, write_section
from dgstream.schemas import DeadLetter
from dgstream.workers.kafka.admin import ensure_topics
from dgstream.workers.kafka.settings import KafkaConnection

MB = 1_000_000
# The default bound (dgstream.workers.steps.inputs.BATCH_RECORDS_AT_LIMIT x the default 1 MiB).
DEFAULT_BOUND = 32 << 20
# RSS samples this often: a bomb's decompression and copies take tens of milliseconds.
SAMPLE_EVERY_S = 0.01
# The cases run again without the consumer's bound, for comparison: the reported bombs.
COMPARED = ("zstd-json", "zstd-byte")
# A case gives up after this long without the good request's answer.
CASE_TIMEOUT_S = 300.0
REQUEST = {
    "state": "see you at the game tonight",
    "questions": {"urgent": {"type": "yes_no", "instructions": "Does it need an answer today?"}},
}


@dataclass(frozen=True)
class Case:
    name: str
    label: str
    codec: str
    kind: str  # "json", "byte" or "none" (a good request alone)
    size: int
    count: int = 1


CASES = [
    Case("good", "a good request alone (no bomb)", "zstd", "none", 0),
    Case("zstd-json", "zstd, 200 MB of `[[],[],...]` JSON", "zstd", "json", 200 * MB),
    Case("zstd-byte", "zstd, 300 MB of one byte", "zstd", "byte", 300 * MB),
    Case("gzip-json", "gzip, 200 MB of JSON", "gzip", "json", 200 * MB),
    Case("gzip-byte", "gzip, 300 MB of one byte", "gzip", "byte", 300 * MB),
    # lz4 frames compress at most about 250x: 300 MB would not fit the broker's 1 MiB.
    Case("lz4-json", "lz4, 200 MB of JSON", "lz4", "json", 200 * MB),
    Case("lz4-byte", "lz4, 200 MB of one byte", "lz4", "byte", 200 * MB),
    Case(
        "zstd-value",
        "zstd, 30 MB of one byte (within the batch bound: one value cut to 1 MiB)",
        "zstd",
        "byte",
        30 * MB,
    ),
    Case(
        "zstd-flood", "zstd, 64 records of 30 MB of one byte in a row", "zstd", "byte", 30 * MB, 64
    ),
]


# ------------------------------------------------------------------ the worker process


def run_worker(settings_json: str, unbounded: bool) -> int:
    """The worker process: a StreamWorker on the fake engine until SIGTERM (a drain)."""
    from dgstream.workers.hosting.settings import WorkerSettings
    from dgstream.workers.hosting.worker import StreamWorker, WorkerFailed

    if unbounded:  # kafka-python's own reading, for comparison
        import dgstream.workers.steps.inputs

        dgstream.workers.steps.inputs.bound_batches = lambda *_: False  # type: ignore[assignment]
    worker = StreamWorker(WorkerSettings.model_validate_json(settings_json))
    signal.signal(
        signal.SIGTERM, lambda *_: threading.Thread(target=worker.drain, daemon=True).start()
    )
    try:
        worker.run()
    except WorkerFailed:
        return 70
    return 0


class Sampler:
    """The peak RSS of a process, sampled on a thread."""

    def __init__(self, pid: int) -> None:
        self._proc = psutil.Process(pid)
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def rss(self) -> int:
        return int(self._proc.memory_info().rss)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.peak = max(self.peak, self.rss())
            except psutil.Error:
                return
            time.sleep(SAMPLE_EVERY_S)

    def __enter__(self) -> Sampler:
        self.peak = self.rss()
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join(5)


# ------------------------------------------------------------------ the run


class Topics:
    """The output and dead-letter topics, read from their beginning."""

    def __init__(self, conn: KafkaConnection, output: str, dead: str) -> None:
        self._c = KafkaConsumer(
            **conn.client_kwargs(client_id="bench-bombs-reader"),
            enable_auto_commit=False,
            auto_offset_reset="earliest",
        )
        tps = [TopicPartition(output, 0), TopicPartition(dead, 0)]
        self._c.assign(tps)
        self._c.seek_to_beginning(*tps)
        self._output = output
        # When each was written: its record's timestamp (the worker's producer sets it at
        # send), so that reading them late costs nothing.
        self.answered: dict[str, float] = {}  # request id -> when its answer was written
        self.letters: list[DeadLetter] = []
        self.lettered: list[float] = []

    def poll(self) -> None:
        for tp, recs in self._c.poll(timeout_ms=50).items():
            for r in recs:
                if tp.topic == self._output:
                    self.answered[json.loads(r.value)["id"]] = r.timestamp / 1000
                else:
                    self.letters.append(DeadLetter.from_record(r.value, r.key, r.headers))
                    self.lettered.append(r.timestamp / 1000)

    def close(self) -> None:
        self._c.close()


def bomb_value(case: Case, scale: float) -> bytes:
    size = int(case.size * scale)
    return json_bomb(size) if case.kind == "json" else byte_bomb(size)


def run_case(
    case: Case,
    scale: float,
    producers: Producers,
    topic: str,
    topics: Topics,
    worker: subprocess.Popen[bytes],
) -> dict[str, Any]:
    """One case: its bombs, then a good request; the worker's peak RSS meanwhile."""
    sampler = Sampler(worker.pid)
    rid = f"good-{case.name}-{uuid.uuid4().hex[:6]}"
    good = Send(json.dumps({"id": rid, **REQUEST}).encode(), "zstd", rid.encode())
    bombs = case.count if case.kind != "none" else 0
    seen = len(topics.letters)
    out: dict[str, Any] = {"case": case, "before": sampler.rss()}
    with sampler:
        if bombs:
            value = bomb_value(case, scale)
            for _ in range(bombs):
                producers.send(topic, [Send(value, case.codec, b"bomb")])
            del value
        bombed = time.time()  # the last bomb is in the topic (or none was sent)
        producers.send(topic, [good])
        written = time.time()
        while rid not in topics.answered or len(topics.letters) < seen + bombs:
            if worker.poll() is not None:
                out["failed"] = f"the worker exited ({worker.returncode})"
                break
            if time.time() > written + CASE_TIMEOUT_S:
                out["failed"] = f"no answer within {CASE_TIMEOUT_S:.0f} s"
                break
            topics.poll()
        else:
            time.sleep(1.0)  # the peak may come after the answer (the dead letters' copies)
    out["peak"] = sampler.peak
    if "failed" in out:
        return out
    new = topics.letters[seen:]
    wire = [re.search(r"(\d+) bytes compressed", d.error.message) for d in new]
    out.update(
        after=sampler.rss(),
        answered_s=topics.answered[rid] - written,
        resumed_s=topics.answered[rid] - bombed,
        lettered_s=max(0.0, max(topics.lettered[seen:], default=bombed) - bombed),
        codes=sorted({d.error.code.value for d in new}),
        letters=len(new),
        wire=max((int(m.group(1)) for m in wire if m), default=None),
    )
    return out


def start_worker(
    boot: str, names: dict[str, str], unbounded: bool, bound: int | None, log: Any
) -> subprocess.Popen[bytes]:
    settings: dict[str, Any] = {
        "pipeline": "bombs",
        "input_topics": [names["in"]],
        "output_topic": names["out"],
        "dead_letter_topic": names["dlq"],
        "group_id": names["group"],
        "kafka": {"bootstrap_servers": boot},
        "engine": {"backend": "fake"},
        "log_level": "WARNING",
    }
    if bound is not None:
        settings["consumer"] = {"max_batch_bytes": bound}
    cmd = [sys.executable, __file__, "--worker", json.dumps(settings)]
    if unbounded:
        cmd.append("--unbounded")
    paths = [str(Path(__file__).resolve().parents[1]), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
    return subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=log)


def run_all(
    boot: str, cases: list[Case], scale: float, unbounded: bool, bound: int | None
) -> list[dict[str, Any]]:
    """`cases` in order against one worker process (topics of its own), after a warm-up."""
    conn = KafkaConnection(bootstrap_servers=boot)
    tag = uuid.uuid4().hex[:8]
    names = {k: f"bombs-{k}-{tag}" for k in ("in", "out", "dlq", "group")}
    ensure_topics(conn, {names["in"]: 1, names["out"]: 1, names["dlq"]: 1})
    results: list[dict[str, Any]] = []
    with tempfile.TemporaryFile() as log:
        worker = start_worker(boot, names, unbounded, bound, log)
        topics = Topics(conn, names["out"], names["dlq"])
        producers = Producers(boot)
        try:
            # Warm: the worker has joined and answered once before anything is measured.
            warm = run_case(CASES[0], 1.0, producers, names["in"], topics, worker)
            if "failed" in warm:
                raise SystemExit(f"the worker did not start: {warm['failed']}")
            for case in cases:
                r = run_case(case, scale, producers, names["in"], topics, worker)
                results.append(r)
                over, base = (r["peak"] - r["before"]) / MB, r["before"] / MB
                took = r.get("failed") or f"answered {r['resumed_s']:.2f} s after the bombs"
                mode = "unbounded" if unbounded else "bounded"
                print(f"{mode} {case.name:>11}: peak +{over:,.0f} MB over {base:,.0f} MB, {took}")
                if worker.poll() is not None:
                    break
        finally:
            producers.close()
            topics.close()
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
                try:
                    worker.wait(60)
                except subprocess.TimeoutExpired:
                    worker.kill()
                    worker.wait()
            if worker.returncode not in (0, None):
                log.seek(0)
                print(log.read().decode(errors="replace")[-3000:], file=sys.stderr)
    return results


def _rows(results: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in results:
        c: Case = r["case"]
        over = (r["peak"] - r["before"]) / MB
        if "failed" in r:
            rows.append(f"| {c.label} | | {r['failed']} | {over:,.0f} | | |")
            continue
        wire = f"{r['wire'] / 1000:,.0f} KB" if r.get("wire") else ""
        codes = ", ".join(f"`{x}` x{r['letters']}" for x in r["codes"]) or "(answered)"
        lettered = f"{r['lettered_s']:.2f}" if c.kind != "none" else ""
        rows.append(
            f"| {c.label} | {wire} | {codes} | {over:,.0f} | {lettered} | {r['resumed_s']:.2f} |"
        )
    return rows


def render(
    results: list[dict[str, Any]],
    unbounded: list[dict[str, Any]],
    args: argparse.Namespace,
    load: float,
) -> str:
    bombs = [r for r in results if r["case"].kind != "none"]
    peak = figure(
        "peak_over_baseline_mb",
        f"{max(((r['peak'] - r['before']) / MB for r in bombs), default=0):,.0f}",
    )

    def slowest(rows: list[dict[str, Any]]) -> str:
        return f"{max((r.get('resumed_s', math.inf) for r in rows), default=0):.1f}"

    one = figure("max_answer_s", slowest([r for r in bombs if r["case"].count == 1]))
    many = figure("flood_answer_s", slowest([r for r in bombs if r["case"].count > 1]))
    without = figure(
        "unbounded_peak_mb",
        f"{max(((r['peak'] - r['before']) / MB for r in unbounded), default=0):,.0f}",
    )
    baseline = results[0]["before"] / MB
    cpu = f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"
    head = (
        "| bombs, then a good request | one bomb on the wire | dead-lettered | peak RSS over "
        "before (MB) | last dead letter, after the last bomb was written (s) | good request "
        "answered, after the last bomb was written (s) |\n|---|---:|---|---:|---:|---:|"
    )
    md = [
        "## Compression bombs: the worker's memory, and the next good request",
        "",
        f"Local single-node Kafka broker (KRaft, loopback), {cpu}, Python "
        f"{platform.python_version()}. One stream worker (a process of its own, the fake "
        "engine, every setting at its default: `consumer.max_batch_bytes` unset, so 32 x "
        "`max_message_bytes` = 32 MiB a batch, and values kept whole up to 1 MiB + 1 byte) "
        "reads a one-partition topic. Each row sends its bombs with librdkafka (each in a "
        "batch of its own, the broker's defaults), then one good request to the same "
        "partition; the worker process's RSS is sampled every 10 ms. Peak = the highest RSS "
        "during the row (until a second after the good request's answer) over the RSS just "
        f"before it; the worker's RSS after start-up was {baseline:,.0f} MB. Times are the "
        "output records' timestamps (set by the worker's producer) less the moment the last "
        f"bomb was in the topic. Load average {load:.1f} at the start.",
        "",
        head,
        *_rows(results),
        "",
        f"Largest peak over the RSS before: **{peak} MB**. The good request behind one bomb "
        f"was answered at most **{one} s** after the bomb was written"
        + (
            f"; behind the 64 values of 30 MB, **{many} s** after the last (the worker "
            "working through them: each is decompressed, cut and dead-lettered with 1 MiB of "
            "its bytes)."
            if any(r["case"].count > 1 for r in bombs)
            else "."
        ),
    ]
    if unbounded:
        md += [
            "",
            "The same worker without the consumer's bound (`workers.steps.inputs.bound_consumer` "
            "left out: kafka-python decompresses each batch whole and copies the value out of "
            "it; the parser and the dead letter's id hint as above; `--no-compare` skips "
            "these rows):",
            "",
            head,
            *_rows(unbounded),
            "",
            f"Without the bound the largest peak was **{without} MB** over the RSS before.",
        ]
    md += [
        "",
        f"Reproduce: `{command(args)}` (starts and stops its own broker; `--bootstrap "
        "host:port` to use another).",
    ]
    return "\n".join(md)


def command(args: argparse.Namespace) -> str:
    cmd = "python bench/bombs.py"
    if args.cases != ",".join(c.name for c in CASES):
        cmd += f" --cases {args.cases}"
    if args.no_compare:
        cmd += " --no-compare"
    return cmd


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--bootstrap", help="an existing broker (default: start a local one)")
    ap.add_argument("--cases", default=",".join(c.name for c in CASES))
    ap.add_argument("--scale", type=float, default=1.0, help="bomb sizes and bound times this")
    ap.add_argument("--no-compare", action="store_true", help="skip the unbounded worker")
    ap.add_argument("--no-write", action="store_true", help="do not update docs/benchmarks.md")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--unbounded", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return run_worker(args.worker, args.unbounded)
    chosen = args.cases.split(",")
    unknown = set(chosen) - {c.name for c in CASES}
    if unknown:
        ap.error(f"unknown cases {sorted(unknown)}")
    cases = [c for c in CASES if c.name == "good" or c.name in chosen]
    compared = [c for c in cases if c.name in COMPARED]
    load = os.getloadavg()[0]
    bound = None if args.scale == 1.0 else max(1 << 16, int(DEFAULT_BOUND * args.scale))

    from bench.worker_overhead import broker_at

    with broker_at(args.bootstrap) as boot:
        results = run_all(boot, cases, args.scale, False, bound)
        unbounded = []
        if compared and not args.no_compare:
            unbounded = run_all(boot, compared, args.scale, True, bound)

    md = render(results, unbounded, args, load)
    print()
    print(md)
    print(f"command: {command(args)}")
    if not (args.no_write or args.scale != 1.0):
        write_section("bombs", md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

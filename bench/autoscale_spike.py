"""Autoscaling on a backlog spike: the controller on a real broker and a real Ray cluster.

The scenario: a Ray cluster of one node declaring 8 GPUs (fake: no device is
used) and 2 CPUs; a pipeline whose topic has 8 partitions, workers on the fake engine
with a fixed cost per read (0.08 s: a worker answers about 12 one-read requests a
second, one batch at a time, as one GPU would), `replicas: {min: 1, max: 8}`, a 2 s poll and a 20 s
scale-in window. 5,000 requests land at once; the controller's records (one per poll)
give the time to reach the cap, the drain, and the return to the minimum; the output
topic, read to its end, gives the answered ids and the duplicates.

    PYTHONPATH=. .venv/bin/python bench/autoscale_spike.py     # its own broker and Ray

Writes the timeline (lag, replicas, throughput against time) to docs/autoscale_timeline.png
and the "autoscale-spike" section of docs/benchmarks.md. The tests
(tests/topology/test_controller_ray.py) run the same scenario (bench/harness/spike.py) and
assert on it; they write nothing.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository

from bench import ROOT
from bench.harness.ray_cluster import ray_cluster
from bench.harness.spike import (
    COST_PER_READ_S,
    GPUS,
    MAX_RECORDS,
    MIN_REPLICAS,
    PARTITIONS,
    POLL_S,
    SCALE_IN_S,
    TARGET_LAG,
    SpikeResult,
    run_spike,
)
from dgstream.workers.kafka.settings import KafkaConnection

# ---------------------------------------------------------------------------- report


def plot(result: SpikeResult, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    t0 = result.spike_at
    recs = [r for r in result.records if r["time"] >= t0 - 6]
    t = [r["time"] - t0 for r in recs]
    fig, (ax_lag, ax_rep, ax_tp) = plt.subplots(3, 1, figsize=(9, 7.5), sharex=True)
    ax_lag.plot(
        t,
        [r["lag"] if r["lag"] is not None else float("nan") for r in recs],
        "-o",
        ms=2.5,
        color="tab:red",
    )
    ax_lag.set_ylabel("group lag (records)")
    ax_rep.step(t, [r["replicas"] for r in recs], where="post", label="replicas", lw=2)
    ax_rep.step(t, [r["ready"] for r in recs], where="post", label="ready (running)", ls="--")
    ax_rep.axhline(result.cap, color="grey", lw=0.8, ls=":", label=f"cap ({result.cap})")
    ax_rep.set_ylabel("workers")
    ax_rep.set_ylim(0, result.cap + 1)
    ax_rep.legend(loc="center", fontsize=8)
    ax_tp.plot(t, [r["throughput_per_s"] for r in recs], "-", color="tab:green")
    ax_tp.set_ylabel("answered / s")
    ax_tp.set_xlabel("seconds since the spike was sent")
    marks = [
        (0.0, "spike"),
        (None if result.cap_at is None else result.cap_at - t0, "cap"),
        (None if result.drained_at is None else result.drained_at - t0, "drained"),
        (None if result.min_at is None else result.min_at - t0, "min"),
    ]
    for ax in (ax_lag, ax_rep, ax_tp):
        for x, _ in marks:
            if x is not None:
                ax.axvline(x, color="grey", lw=0.7, ls="--")
        ax.grid(alpha=0.3)
    for k, (x, label) in enumerate(marks):
        if x is not None:
            ax_lag.annotate(
                label,
                (x, 1.0 - 0.08 * (k % 2)),
                xycoords=("data", "axes fraction"),
                xytext=(2, -10),
                textcoords="offset points",
                fontsize=8,
            )
    f = result.figures()
    fig.suptitle(
        f"{result.sent:,} requests into {PARTITIONS} partitions; fake engine "
        f"{COST_PER_READ_S:g} s/read; poll {POLL_S:g} s, scale-in window {SCALE_IN_S:g} s\n"
        f"cap in {f['time_to_cap_s']} s after the first lag seen, drained at {f['drain_s']} s, "
        f"back to {MIN_REPLICAS} at {f['back_to_min_s']} s",
        fontsize=9,
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(result: SpikeResult, command: str) -> str:
    import platform

    f = result.figures()
    min_line = f"{f['min_after_drain_s']} s later (window {SCALE_IN_S:g} s)"
    dup_line = f"{f['duplicates']} (<= {f['duplicate_bound']})"
    return f"""## Autoscaling: a backlog spike (controller, real broker, real Ray)

Local single-node Kafka broker; a Ray cluster of one node declaring {GPUS} (fake) GPUs and
2 CPUs ({os.cpu_count()} cores, {platform.machine()}), token authentication on. Pipeline:
{PARTITIONS} partitions; the fake engine at {COST_PER_READ_S:g} s per read (one read a
request, one batch of up to {MAX_RECORDS} at a time per worker: about 12 requests/s a
worker); `replicas: {{min: {MIN_REPLICAS}, max: {GPUS}}}`; target lag {TARGET_LAG} per
replica; poll {POLL_S:g} s; scale-in window {SCALE_IN_S:g} s. {result.sent:,} requests
sent at once. Times are from the first send.

| figure | value |
|---|---:|
| sending the spike | {f["produce_s"]} s |
| first poll seeing the lag | {f["first_lag_s"]} s |
| polls from that one to the cap ({result.cap} replicas) | {f["polls_to_cap"]} |
| all {result.cap} workers running (process, imports, engine) | {f["all_ready_s"]} s |
| backlog drained (lag 0) | {f["drain_s"]} s |
| back to {MIN_REPLICAS} replica, after the drain | {min_line} |
| peak throughput (10 s average) | {f["peak_throughput_per_s"]} requests/s |
| answered / sent | {f["answered"]:,} / {result.sent:,} |
| duplicates (bound: replica changes x in-flight window) | {dup_line} |
| scaling decisions | {f["scaling_decisions"]} |

![lag, replicas and throughput against time](autoscale_timeline.png)

The controller creates the actors in the poll that sees the spike; on this 2-core machine
they then need most of half a minute for their process, imports and engine, and some
seconds more for the group to hand them partitions, before the pool drains at full rate.
Scale-in waits for a window of calm; it also keeps the replicas the engines' load needs
(busy engine-seconds per second / 0.8), so the pool shrinks in steps as the drain's load
leaves the window. Runs vary with the workers' start and the group's rebalances: a run in
which the group hands the new members their partitions late drains later.

Reproduce: `{command}`.
"""


def main() -> int:
    from bench.report import write_section
    from dgstream.infra.kafka import broker

    home = tempfile.mkdtemp(prefix="dgas-kafka-")
    info = broker.start(home, port=0)
    try:
        conn = KafkaConnection(bootstrap_servers=info.bootstrap_servers)
        with ray_cluster([{"num_cpus": 2, "num_gpus": GPUS}]):
            result = run_spike(conn)
    finally:
        broker.stop(home, delete_data=True)
        shutil.rmtree(home, ignore_errors=True)
    print(json.dumps(result.figures(), indent=2))
    png = ROOT / "docs" / "autoscale_timeline.png"
    plot(result, png)
    write_section(
        "autoscale-spike",
        markdown(result, "PYTHONPATH=. .venv/bin/python bench/autoscale_spike.py"),
    )
    print(f"wrote {png} and the autoscale-spike section of docs/benchmarks.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())

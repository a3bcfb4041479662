"""The autoscaling spike scenario: a pipeline on the fake engine with a fixed cost per
read, a backlog landing at once, and the controller's records of how the pool grew, drained
and came back to its minimum. `tests/topology/test_controller_ray.py` asserts on it;
`bench/autoscale_spike.py` runs it bigger and draws it.

The scenario: a Ray cluster of one node declaring 8 GPUs (fake: no device is used) and
2 CPUs; a pipeline whose topic has 8 partitions, `replicas: {min: 1, max: 8}`, a 2 s poll
and a 20 s scale-in window."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from bench.harness.pipeline import INLINE, OutputReader, Pipeline, count_duplicates
from bench.harness.ray_cluster import NAMESPACE, pipeline_status, running_controller, timeline
from bench.harness.waiting import wait_for
from dgstream.workers.kafka.settings import KafkaConnection

# ---------------------------------------------------------------------------- the scenario

SPIKE_REQUESTS = 5000
PARTITIONS = 8
GPUS = 8
# The fake engine's cost per read; every request asks the two INLINE questions, which
# share one read. One batch at a time (max_in_flight 1: the fake engine's calls would
# otherwise overlap, which a GPU's do not), 16 records a batch (a 1.28 s call): a worker
# answers about 12 requests a second (measured: 16 / (1.28 s + ~0.05 s of Kafka and
# parsing)), the pool at the cap about 95, so 5,000 drain in under a minute at the cap.
COST_PER_READ_S = 0.08
MAX_RECORDS = 16
# 8 workers x 0.25 CPU fill the machine's 2 cores (each worker mostly sleeps in the
# fake engine; the controller takes none).
CPUS_PER_WORKER = 0.25
POLL_S = 2.0
SCALE_IN_S = 20.0
# 5,000 / 500 = 10 replicas asked: above the cap, so the first poll that sees the whole
# spike goes straight to it.
TARGET_LAG = 500
ACTIVATION_LAG = 0
MIN_REPLICAS = 1


def request_value(rid: str, i: int) -> bytes:
    """A request asking the INLINE questions (one read)."""
    body = {"id": rid, "state": f"message {i}: see you at the game", "questions": INLINE}
    return json.dumps({**body, "metadata": {"n": i}}).encode()


def topology(
    bootstrap: list[str],
    name: str,
    *,
    deployment: str | None = None,
    namespace: str = NAMESPACE,
    partitions: int = PARTITIONS,
    min_replicas: int = MIN_REPLICAS,
    max_replicas: int = GPUS,
    cost_per_read_s: float = COST_PER_READ_S,
    target_lag: int = TARGET_LAG,
    activation_lag: int = ACTIVATION_LAG,
    poll_s: float = POLL_S,
    scale_in_s: float = SCALE_IN_S,
    cpus: float = CPUS_PER_WORKER,
    gpus: float = 1.0,
    engine: dict[str, Any] | None = None,
    max_records: int = MAX_RECORDS,
) -> dict[str, Any]:
    """A one-pipeline topology; its topics and group are named after `name`. `engine`:
    the fake engine at `cost_per_read_s` unless given (the GPU run's vLLM settings)."""
    return {
        "kafka": {"bootstrap_servers": bootstrap},
        "ray": {"namespace": namespace, "deployment": deployment or name},
        "pipelines": [
            {
                "name": name,
                "input_topics": [f"{name}-in"],
                "output_topic": f"{name}-out",
                "dead_letter_topic": f"{name}-dlq",
                "consumer_group": f"{name}-group",
                "topics": {"partitions": partitions, "replication_factor": 1},
                "engine": engine or {"backend": "fake", "fake_cost_per_read_s": cost_per_read_s},
                "batching": {"max_records": max_records, "max_wait_ms": 50, "max_in_flight": 1},
                "resources": {"gpus": gpus, "cpus": cpus},
                "replicas": {"min": min_replicas, "max": max_replicas},
                "autoscale": {
                    "target_lag_per_replica": target_lag,
                    "activation_lag": activation_lag,
                    "scale_out_stabilization_s": 0,
                    "scale_in_stabilization_s": scale_in_s,
                    "poll_interval_s": poll_s,
                },
            }
        ],
    }


def unique(prefix: str) -> str:
    """A pipeline name (lowercase, digits, dashes) that no earlier run used."""
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def pipeline_io(conn: KafkaConnection, topo: dict[str, Any]) -> Pipeline:
    """The worker tests' `Pipeline` (produce, readers, lag) on the topology's topics."""
    p = topo["pipelines"][0]
    return Pipeline(
        conn,
        input=p["input_topics"][0],
        output=p["output_topic"],
        dead=p["dead_letter_topic"],
        group=p["consumer_group"],
    )


# ---------------------------------------------------------------------------- the run


@dataclass
class SpikeResult:
    records: list[dict[str, Any]]  # the controller's, one per poll
    spike_at: float  # wall time the first request was sent
    produce_s: float
    first_lag_at: float  # the first poll that saw lag above activation
    cap: int
    cap_at: float | None  # the first poll after which the pool had `cap` replicas
    ready_at: float | None  # ... and all of them answering "running"
    drained_at: float | None  # the first poll after the peak that saw lag 0
    min_at: float | None  # the first poll after that deciding the minimum (drains start)
    sent: int
    answered: int
    duplicates: int
    dead_letters: int
    peak_throughput: float
    scaling_decisions: int
    bound: int  # duplicates allowed: replicas changes x a worker's in-flight window

    def figures(self) -> dict[str, Any]:
        def since(t: float | None, ref: float) -> float | None:
            return None if t is None else round(t - ref, 1)

        return {
            "requests": self.sent,
            "cap": self.cap,
            "produce_s": round(self.produce_s, 1),
            "first_lag_s": since(self.first_lag_at, self.spike_at),
            "time_to_cap_s": since(self.cap_at, self.first_lag_at),
            "polls_to_cap": None
            if self.cap_at is None
            else round((self.cap_at - self.first_lag_at) / POLL_S),
            "all_ready_s": since(self.ready_at, self.spike_at),
            "drain_s": since(self.drained_at, self.spike_at),
            "back_to_min_s": since(self.min_at, self.spike_at),
            "min_after_drain_s": None
            if self.min_at is None or self.drained_at is None
            else round(self.min_at - self.drained_at, 1),
            "answered": self.answered,
            "duplicates": self.duplicates,
            "duplicate_bound": self.bound,
            "dead_letters": self.dead_letters,
            "peak_throughput_per_s": round(self.peak_throughput, 1),
            "scaling_decisions": self.scaling_decisions,
        }


def run_spike(
    conn: KafkaConnection,
    *,
    requests: int = SPIKE_REQUESTS,
    gpus: int = GPUS,
    on_cap: Any = None,
    **topology_kw: Any,
) -> SpikeResult:
    """The spike on a connected Ray cluster with `gpus` GPUs and the broker of `conn`.

    `topology_kw` goes to `topology` (the GPU run's engine, batch size, target lag);
    `on_cap(controller, name)` runs once the pool is at its cap (the GPU run reads each
    replica's GPU there)."""
    name = unique("spike")
    topo = topology(list(conn.bootstrap_servers), name, **topology_kw)
    io = pipeline_io(conn, topo)
    cap = min(topology_kw.get("max_replicas", GPUS), PARTITIONS, gpus)
    reader: OutputReader | None = None
    with running_controller(topo) as ctl:
        # The minimum pool, idle (the controller created the topics).
        wait_for(
            lambda: (s := pipeline_status(ctl, name))["ready"] == MIN_REPLICAS and s["lag"] == 0,
            180,
            "the minimum pool, ready and idle",
            every_s=0.5,
        )
        ids = [f"s{i}" for i in range(requests)]
        spike_at = time.time()
        io.produce([request_value(r, i) for i, r in enumerate(ids)], keys=[r.encode() for r in ids])
        produce_s = time.time() - spike_at
        reader = io.reader()
        want = set(ids)
        if on_cap is not None:
            wait_for(
                lambda: pipeline_status(ctl, name)["ready"] >= cap,
                600,
                f"{cap} replicas serving",
                every_s=1.0,
            )
            on_cap(ctl, name)
        reader.read_until(lambda r: set(r.keys()) >= want, 900, f"all {requests} results")
        # Back to the minimum: the scale-in window after the drain, then the drains.
        wait_for(
            lambda: (
                (s := pipeline_status(ctl, name))["replicas"] == MIN_REPLICAS
                and s["draining"] == 0
                and s["lag"] == 0
            ),
            SCALE_IN_S * 6 + 120,
            "the pool back at the minimum",
            every_s=1.0,
        )
        time.sleep(2 * POLL_S)  # two more polls: the timeline shows the pool at rest
        records = timeline(ctl, name)
        st = pipeline_status(ctl, name)
    # Drained and stopped: the output topic is complete; read it to its end.
    reader.read_to_end()
    keys = reader.keys()
    reader.close()
    dead = OutputReader(conn, io.dead)
    dead.read_to_end()
    dead_letters = len(dead.records)
    dead.close()
    for rec in reader.records:
        body = json.loads(rec.value)
        assert body["status"] == "ok" and set(body["answers"]) == set(INLINE), body

    after = [r for r in records if r["time"] >= spike_at]
    first_lag = next(r for r in after if (r["lag"] or 0) > ACTIVATION_LAG)
    later = [r for r in after if r["time"] >= first_lag["time"]]
    cap_rec = next((r for r in later if r["replicas"] >= cap), None)
    ready_rec = next((r for r in later if r["ready"] >= cap), None)
    peak_i = max(range(len(later)), key=lambda i: later[i]["lag"] or 0)
    drained = next((r for r in later[peak_i:] if r["lag"] == 0), None)
    min_rec = None
    if drained is not None:
        min_rec = next(
            (r for r in later if r["time"] >= drained["time"] and r["replicas"] == MIN_REPLICAS),
            None,
        )
    changes = sum(abs(r["desired"] - r["current"]) for r in after if r["changed"])
    return SpikeResult(
        records=records,
        spike_at=spike_at,
        produce_s=produce_s,
        first_lag_at=first_lag["time"],
        cap=cap,
        cap_at=None if cap_rec is None else cap_rec["time"],
        ready_at=None if ready_rec is None else ready_rec["time"],
        drained_at=None if drained is None else drained["time"],
        min_at=None if min_rec is None else min_rec["time"],
        sent=requests,
        answered=len(set(keys) & set(ids)),
        duplicates=count_duplicates(keys),
        dead_letters=dead_letters,
        peak_throughput=max((r["throughput_per_s"] or 0.0) for r in after),
        scaling_decisions=int(st["scaling_decisions"]),
        # Each replica joining or leaving rebalances the group; a batch in flight on a
        # revoked partition may be answered again by its next owner: at most one batch
        # per worker per change (max_in_flight 1 x MAX_RECORDS), plus restarts.
        bound=(changes + int(st["restarts"])) * cap * topology_kw.get("max_records", MAX_RECORDS),
    )

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
(tests/topology/test_controller_ray.py) run the same scenario and assert on it; they
write nothing. The helpers here (a Ray cluster with token authentication, the topology,
a running controller) serve both.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import socket
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
# The tests' helpers: waiting (tests/) and worker_helpers (tests/worker/).
for _p in (ROOT, ROOT / "tests", ROOT / "tests" / "worker"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))

from waiting import wait_for  # noqa: E402
from worker_helpers import INLINE, OutputReader, Pipeline, count_duplicates  # noqa: E402

from workers.kafka_settings import KafkaConnection  # noqa: E402

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
NAMESPACE = "dgstream-autoscale"


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


# ---------------------------------------------------------------------------- Ray


def _refresh_ray_auth() -> None:
    """Ray caches the authentication mode (its config) and the token in each process:
    make this one read the environment again."""
    with contextlib.suppress(Exception):
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()


@contextlib.contextmanager
def ray_token_auth() -> Iterator[str]:
    """RAY_AUTH_MODE=token with a fresh random token for the clusters started inside
    (Ray's gRPC servers listen on every interface here); the environment is restored after."""
    keys = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")
    saved = {k: os.environ.get(k) for k in keys}
    token = secrets.token_hex(32)
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ["RAY_AUTH_TOKEN"] = token
    os.environ.pop("RAY_AUTH_TOKEN_PATH", None)
    _refresh_ray_auth()
    try:
        yield token
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        _refresh_ray_auth()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@dataclass
class RayCluster:
    cluster: Any
    address: str
    token: str
    node_names: dict[str, str] = field(default_factory=dict)  # node id -> custom resource
    dashboard: bool = False
    temp_dir: str = ""  # the head's Ray temp dir (sessions, logs); removed after


@contextlib.contextmanager
def ray_cluster(
    nodes: list[dict[str, Any]], *, dashboard: bool = False, namespace: str = NAMESPACE
) -> Iterator[RayCluster]:
    """A Ray cluster of our own on this machine (`ray.cluster_utils.Cluster`: one node
    per entry of `nodes`, the first the head), with token authentication, this process
    connected to it. Everything is stopped after; never `ray stop` (other clusters run here).

    Each node may name itself with a custom resource (`resources: {"node-a": 1}`)."""
    import ray
    from ray.cluster_utils import Cluster

    from topology.local_ray import private_ray_tmp

    if ray.is_initialized():
        raise RuntimeError("this process is already connected to a Ray cluster")
    # Cluster() writes (and its shutdown deletes) the "current cluster" file in Ray's
    # default temp dir: a private one, so that no shared /tmp/ray is needed or touched.
    with private_ray_tmp("dgas-") as temp_dir, ray_token_auth() as token:
        head = {**nodes[0], "temp_dir": str(temp_dir), "include_dashboard": dashboard}
        if dashboard:
            head.update(dashboard_host="127.0.0.1", dashboard_port=_free_port())
        cluster = None
        try:
            cluster = Cluster(initialize_head=True, head_node_args=head)
            for node in nodes[1:]:
                cluster.add_node(**node)
            cluster.wait_for_nodes()
            ray.init(
                address=cluster.address,
                namespace=namespace,
                log_to_driver=False,
                logging_level="WARNING",
            )
            names = {}
            for n in ray.nodes():
                custom = [k for k in n["Resources"] if k.startswith("node-")]
                if custom:
                    names[n["NodeID"]] = custom[0]
            yield RayCluster(cluster, cluster.address, token, names, dashboard, str(temp_dir))
        finally:
            with contextlib.suppress(Exception):
                ray.shutdown()
            if cluster is not None:
                cluster.shutdown()


def kill_workers(namespace: str, prefix: str = "dgstream-") -> int:
    """Every named actor of `namespace` whose name starts with `prefix` (leftovers)."""
    import ray

    killed = 0
    for entry in ray.util.list_named_actors(all_namespaces=True):
        if entry["namespace"] == namespace and entry["name"].startswith(prefix):
            with contextlib.suppress(Exception):
                ray.kill(ray.get_actor(entry["name"], namespace=namespace), no_restart=True)
                killed += 1
    return killed


@contextlib.contextmanager
def running_controller(topo: dict[str, Any], *, drain: bool = True) -> Iterator[Any]:
    """The topology's controller, started; shut down (workers drained) and removed after,
    with any worker of its namespace left behind."""
    import ray

    from topology.controller import start_controller, stop_controller
    from workers.actor import replica_prefix

    ns, deployment = topo["ray"]["namespace"], topo["ray"]["deployment"]
    ctl = start_controller(topo, deployment, ns)
    try:
        ray.get(ctl.ping.remote(), timeout=120)
        yield ctl
    finally:
        stop_controller(ctl, drain=drain, timeout_s=150)
        kill_workers(ns, replica_prefix(deployment, topo["pipelines"][0]["name"]))


def pipeline_status(ctl: Any, name: str) -> dict[str, Any]:
    import ray

    st: dict[str, Any] = ray.get(ctl.status.remote(), timeout=60)
    out: dict[str, Any] = st["pipelines"][name]
    return out


def timeline(ctl: Any, name: str) -> list[dict[str, Any]]:
    import ray

    out: list[dict[str, Any]] = ray.get(ctl.history.remote(name), timeout=60)[name]
    return out


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
    from infra.kafka import broker

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

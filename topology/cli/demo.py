"""`dgstream demo`: the main job on this machine, end to end.

1. Start a real Kafka broker on loopback (its own state folder, a free port).
2. Start a local Ray cluster (token authentication on, every server on 127.0.0.1, the
   dashboard and the metrics endpoints among them: dgstream.topology.local_ray).
3. Start the moderation topology's controller; it creates the topics and starts a worker
   (a Ray actor) with the embedded demo model.
4. Produce sample events (and one malformed message) with the truth in their metadata.
5. Show answers as they arrive, with probabilities and whether they match the truth.
6. With `--events N`: once N are answered, print a summary and stop everything. Ctrl-C
   stops everything too. Nothing is left running.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import tempfile
import time
from typing import Any

from dgstream.schemas import ClassificationResult, DeadLetter
from dgstream.schemas.kinds import get_kind, name_of

REQUESTS, RESULTS, DEAD = "demo.requests", "demo.results", "demo.dead-letters"
# The checkpoint in workers/engine/weights/demo (docs/benchmarks.md has its accuracy).
DEMO_MODEL = "demo"


def topology(bootstrap: str, model: str) -> dict[str, Any]:
    from dgstream.topology.demo_tasks import MODERATION_QUESTIONS

    return {
        "kafka": {"bootstrap_servers": [bootstrap]},
        "ray": {"namespace": "dgstream-demo", "deployment": "demo"},
        "question_sets": {"moderation": MODERATION_QUESTIONS},
        "pipelines": [
            {
                "name": "moderation",
                "input_topics": [REQUESTS],
                "output_topic": RESULTS,
                "dead_letter_topic": DEAD,
                "consumer_group": "dgstream-demo",
                "topics": {"partitions": 2},
                "question_sets": ["moderation"],
                "engine": {"backend": "transformers", "model": model, "device": "cpu"},
                # Small batches keep the table moving on a 2-core machine.
                "batching": {"max_records": 8, "max_wait_ms": 20, "max_in_flight": 2},
                "resources": {"gpus": 0, "cpus": 1},
                "replicas": {"min": 1, "max": 1},
                "autoscale": {"poll_interval_s": 2},
            }
        ],
    }


def _cell(answer: dict[str, Any], truth: str | None) -> str:
    got = name_of(answer)
    if got is None:
        return "skipped"
    text = f"{got[:7]} {answer[get_kind(answer['type']).headline]:.2f}"
    mark = "" if truth is None else (" ok" if got == truth else " x")
    return text + mark


# Ray starts its worker processes at niceness 15 (`RAY_worker_niceness`, read by the raylet
# it starts). On a 2-core machine with anything else busy, the worker then gets a few
# percent of a core: the demo worker once took minutes to import torch. The demo's cluster
# is the user's own and runs nothing else, so its workers run at normal priority.
LOCAL_WORKER_NICENESS = ("RAY_worker_niceness", "0")

# How long a quiet demo waits before it says what the pool is doing (a first answer
# takes about 10 s on a 2-core machine: the worker loads the model and joins the group).
_QUIET_REPORT_S = 30.0


def run_demo(
    events: int | None, ray_tmp: str, model: str = DEMO_MODEL, timeout_s: float = 600.0
) -> int:
    """The demo; `ray_tmp` is the local Ray's own temp dir (dgstream.topology.local_ray)."""
    import ray

    from dgstream.infra.kafka import broker
    from dgstream.topology.controller import start_controller
    from dgstream.topology.demo_tasks import MODERATION_QUESTIONS
    from dgstream.topology.local_ray import start_local_ray
    from dgstream.workers.kafka.admin import ensure_topics

    t0 = time.perf_counter()
    home = tempfile.mkdtemp(prefix="dgstream-demo-")
    ctl = None
    answered: dict[str, ClassificationResult] = {}
    dead: list[DeadLetter] = []
    try:
        print("1. starting a Kafka broker on 127.0.0.1 ...", flush=True)
        info = broker.start(home=home, port=0)
        print(f"   ready at {info.bootstrap} in {info.start_seconds:.1f}s", flush=True)

        print("2. starting a local Ray cluster (token authentication on) ...", flush=True)
        ctx = start_local_ray(ray_tmp, "dgstream-demo")
        print(f"   Ray dashboard: http://{ctx.dashboard_url}", flush=True)

        print("3. starting the moderation topology (controller and worker) ...", flush=True)
        topo = topology(info.bootstrap, model)
        ensure_topics(info.bootstrap, {REQUESTS: 2, RESULTS: 2, DEAD: 1})
        ctl = start_controller(topo, "demo", "dgstream-demo")

        n = events if events is not None else 1_000_000
        print(f"4. producing {min(n, 10_000) if events else 'sample'} events ...", flush=True)
        want = _produce(info.bootstrap, events)

        qids = list(MODERATION_QUESTIONS)
        print("5. answers (one denoising step each; 'ok'/'x' against the truth):", flush=True)
        print("   " + "  ".join(f"{q[:12]:16s}" for q in ["id", *qids]), flush=True)
        deadline = time.monotonic() + timeout_s
        _collect(info.bootstrap, ctl, qids, want, deadline, answered, dead)
        _summary(answered, dead, qids, time.perf_counter() - t0)
        status = ray.get(ctl.status.remote(), timeout=60)
        p = status["pipelines"]["moderation"]
        print(f"   pool: {p['replicas']} worker(s): {', '.join(p['workers'])}", flush=True)
        if len(answered) == want and len(dead) == 1:
            return 0
        if time.monotonic() >= deadline:
            print(f"   gave up after {timeout_s:.0f}s; the workers' logs end with:", flush=True)
            _print_worker_logs(ray_tmp)
        else:
            print(f"   expected {want} answers and 1 dead letter", flush=True)
        return 1
    except KeyboardInterrupt:
        print("\nstopping ...", flush=True)
        return 130
    finally:
        if ctl is not None:
            with contextlib.suppress(Exception):
                ray.get(ctl.shutdown.remote(True), timeout=120)
            ray.kill(ctl, no_restart=True)
        if ray.is_initialized():
            ray.shutdown()
        broker.stop(home=home, delete_data=True)
        shutil.rmtree(home, ignore_errors=True)
        print(f"6. stopped everything ({time.perf_counter() - t0:.1f}s in all)", flush=True)


def _produce(bootstrap: str, events: int | None) -> int:
    """The sample events (50 unless `events`), then one malformed request; returns how
    many answers to wait for."""
    from kafka import KafkaProducer

    from dgstream.topology.demo_tasks import sample_events

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
    batch = sample_events(events if events is not None else 50, seed=int(time.time()) % 997)
    for ev in batch:
        producer.send(REQUESTS, key=ev["id"].encode(), value=json.dumps(ev).encode())
    producer.send(REQUESTS, key=b"bad-1", value=b'{"id": "bad-1", "state": 42}')
    producer.flush()
    producer.close()
    return len(batch)


def _collect(
    bootstrap: str,
    ctl: Any,
    qids: list[str],
    want: int,
    deadline: float,
    answered: dict[str, ClassificationResult],
    dead: list[DeadLetter],
) -> None:
    """Read results and dead letters until `want` answers and the one dead letter are in
    (or the deadline), printing each; a quiet spell prints the pool's state."""
    from kafka import KafkaConsumer

    consumer = KafkaConsumer(
        RESULTS,
        DEAD,
        bootstrap_servers=bootstrap,
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        group_id=None,
    )
    quiet_since = time.monotonic()
    # One malformed message was sent too: wait for its dead letter as well.
    while (len(answered) < want or not dead) and time.monotonic() < deadline:
        polled = consumer.poll(timeout_ms=500)
        if polled:
            quiet_since = time.monotonic()
        elif time.monotonic() - quiet_since > _QUIET_REPORT_S:
            print(f"   (no answer for {_QUIET_REPORT_S:.0f}s: {_pool_line(ctl)})", flush=True)
            quiet_since = time.monotonic()
        for tp, records in polled.items():
            for rec in records:
                _show(tp.topic, rec.value, qids, answered, dead)
    consumer.close()


def _show(
    topic: str,
    value: bytes,
    qids: list[str],
    answered: dict[str, ClassificationResult],
    dead: list[DeadLetter],
) -> None:
    """Print one record of the results or dead-letter topic (a repeated result once)."""
    if topic == DEAD:
        dl = DeadLetter.model_validate_json(value)
        dead.append(dl)
        print(f"   dead letter: {dl.error.code}: {dl.error.message}", flush=True)
        return
    res = ClassificationResult.model_validate_json(value)
    if res.id in answered:
        return
    answered[res.id] = res
    truth = res.metadata.get("truth", {})
    cells = [_cell(res.answers[q].model_dump(), truth.get(q)) for q in qids]
    print("   " + "  ".join(f"{c[:16]:16s}" for c in [res.id[-8:], *cells]), flush=True)


def _pool_line(ctl: Any) -> str:
    """One line on the pool from the controller: replicas, their states, lag, errors."""
    import ray

    try:
        st = ray.get(ctl.status.remote(), timeout=20)
    except Exception as exc:  # the controller itself is stuck or gone: say so
        return f"the controller does not answer ({type(exc).__name__})"
    p = st["pipelines"]["moderation"]
    states = ", ".join(f"{k}: {v}" for k, v in p["worker_states"].items()) or "none started"
    errors = [e for e in (p.get("error"), p.get("setup_error"), p.get("lag_error")) if e]
    return f"workers [{states}], lag {p['lag']}" + (f", errors: {errors}" if errors else "")


def _print_worker_logs(ray_tmp: str, lines: int = 12) -> None:
    """The last lines of each Ray worker's stderr (where a failing actor's traceback is)."""
    from pathlib import Path

    # session_latest is a link to the session folder: each file once.
    paths = {p.resolve() for p in Path(ray_tmp).glob("session_*/logs/worker-*.err")}
    for path in sorted(paths)[:8]:
        tail = path.read_text(errors="replace").strip().splitlines()[-lines:]
        if tail:
            print(f"   --- {path.name}", flush=True)
            for ln in tail:
                print(f"   {ln}", flush=True)


def _summary(
    answered: dict[str, ClassificationResult],
    dead: list[DeadLetter],
    qids: list[str],
    seconds: float,
) -> None:
    right = dict.fromkeys(qids, 0)
    for res in answered.values():
        truth = res.metadata.get("truth", {})
        for q in qids:
            got = name_of(res.answers[q])
            right[q] += int(got == truth.get(q))
    n = max(len(answered), 1)
    acc = ", ".join(f"{q} {right[q] / n:.0%}" for q in qids)
    print(
        f"   {len(answered)} answered, {len(dead)} dead-lettered in {seconds:.1f}s; "
        f"agreement with the truth: {acc}",
        flush=True,
    )


def main(events: int | None, timeout_s: float = 600.0) -> int:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # Ray reads its authentication mode when it is imported: set it first. The demo's Ray
    # listens on loopback only (start_local_ray); the token keeps out the machine's other
    # users, except from the metrics endpoints, which Ray serves without one.
    os.environ["RAY_AUTH_MODE"] = "token"
    os.environ.setdefault("RAY_AUTH_TOKEN", secrets.token_hex(32))
    os.environ.setdefault(LOCAL_WORKER_NICENESS[0], LOCAL_WORKER_NICENESS[1])
    # A SIGTERM (a supervisor, a test's timeout) stops everything as Ctrl-C does.
    signal.signal(signal.SIGTERM, _interrupt)
    from dgstream.topology.local_ray import private_ray_tmp

    with private_ray_tmp("dgdemo-") as ray_tmp:
        return run_demo(events, str(ray_tmp), timeout_s=timeout_s)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt

"""The controller of a deployment: a named, detached Ray actor that keeps every pipeline's
pool of workers sized to its backlog.

Per pipeline, every `autoscale.poll_interval_s` (numbered as in `PipelineRunner.tick`):
1. Measure the group's lag from Kafka (end offset - committed offset, summed). A failed
   query is not a lag of zero: the size stays and the decision says why.
2. Count the GPUs that can be had: free in the cluster plus those this pipeline holds.
3. Decide the size (`topology.autoscaler`): ceil(lag / target), within min, max,
   partitions and GPUs, with activation and stabilization windows.
4. Apply it: start replicas (asking Ray's autoscaler for GPUs when the cluster lacks
   them), or drain the highest replicas (stop fetching, finish, commit, leave) and remove.
5. Check health: a replica whose actor is gone for good is started again.
6. Publish status and metrics: replicas, desired, lag, throughput, recent decisions.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from topology.autoscaler import Autoscaler, Decision, Policy
from topology.spec import PipelineSpec, Topology, parse_topology
from workers.kafka_settings import KafkaConnection

CONTROLLER_PREFIX = "dgstream-controller"
DEFAULT_NAMESPACE = "dgstream"
# Recent decisions kept for `status()`: a few minutes of history at a 5 s poll.
_DECISIONS_KEPT = 50
# A replica that does not answer a ping within this long is checked again next tick; Ray
# restarts crashed actors by itself (max_restarts=-1), so only a dead one is replaced.
_PING_TIMEOUT_S = 10.0


def controller_name(deployment: str) -> str:
    return f"{CONTROLLER_PREFIX}-{deployment}"


@dataclass
class _Replica:
    index: int
    handle: Any
    started: float
    draining: bool = False


@dataclass
class PipelineRunner:
    """The control loop of one pipeline (plain Python: the actor runs it on a thread)."""

    topology: Topology
    spec: PipelineSpec
    connection: KafkaConnection
    namespace: str
    clock: Callable[[], float] = time.monotonic
    replicas: dict[int, _Replica] = field(default_factory=dict)
    decisions: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_DECISIONS_KEPT))
    lag: int | None = None
    lag_error: str = ""
    partitions: int = 0
    throughput: float = 0.0
    restarts: int = 0
    _answered: tuple[float, int] | None = None
    _drains: list[threading.Thread] = field(default_factory=list)

    def __post_init__(self) -> None:
        a = self.spec.autoscale
        self.autoscaler = Autoscaler(
            Policy(
                min_replicas=self.spec.replicas.min,
                max_replicas=self.spec.replicas.max,
                target_lag_per_replica=a.target_lag_per_replica,
                activation_lag=a.activation_lag,
                scale_out_window_s=a.scale_out_stabilization_s,
                scale_in_window_s=a.scale_in_stabilization_s,
            )
        )

    # ------------------------------------------------------------------ settings

    def worker_settings(self, replica: int) -> Any:
        from workers.settings import ActorResources, Batching, WorkerSettings

        s = self.spec
        return WorkerSettings(
            pipeline=s.name,
            input_topics=s.input_topics,
            output_topic=s.output_topic,
            dead_letter_topic=s.dead_letter_topic,
            group_id=s.consumer_group,
            kafka=self.connection,
            engine=s.engine,
            question_sets=self.topology.question_sets_for(s),
            batching=Batching(**s.batching.model_dump()),
            delivery=s.delivery,
            static_membership=s.static_membership,
            replica=replica,
            resources=ActorResources(
                gpus=s.resources.gpus, cpus=s.resources.cpus, custom=s.resources.custom
            ),
        )

    def actor_name(self, replica: int) -> str:
        return f"dgstream-{self.spec.name}-{replica}"

    # ------------------------------------------------------------------ the loop

    def tick(self) -> Decision:
        now = self.clock()
        # 1. lag from Kafka
        self._measure_lag()
        # 2. GPUs that can be had
        capacity = self._capacity()
        # 3. decide
        running = self._running()
        decision = self.autoscaler.decide(
            now, len(running), self.lag, max(self.partitions, 1), capacity, error=self.lag_error
        )
        # 4. apply
        if decision.desired > len(running):
            self._scale_out(decision.desired, capacity)
        elif decision.desired < len(running):
            self._scale_in(decision.desired)
        # 5. health
        self._check_health()
        # 6. status
        self._measure_throughput(now)
        self.decisions.append(
            {
                "time": time.time(),
                "current": decision.current,
                "desired": decision.desired,
                "lag": decision.lag,
                "reason": decision.reason,
                "changed": decision.changes,
            }
        )
        self._publish_metrics(decision)
        return decision

    def _measure_lag(self) -> None:
        from workers.kafka_admin import compute_lag, total_lag

        try:
            per_partition = compute_lag(
                self.connection, self.spec.consumer_group, self.spec.input_topics, timeout_s=5.0
            )
            self.lag, self.lag_error = total_lag(per_partition), ""
            self.partitions = len(per_partition) or self.partitions
        except Exception as exc:  # any failure: the lag is unknown, not zero
            self.lag, self.lag_error = None, f"{type(exc).__name__}: {exc}"

    def _per_worker(self) -> tuple[float, float]:
        return float(self.spec.resources.gpus), float(self.spec.resources.cpus)

    def _capacity(self) -> int:
        """Replicas this pipeline could run now: what it holds plus what is free."""
        gpus, cpus = self._per_worker()
        held = len(self._running())
        free = ray.available_resources()
        if gpus > 0:
            return held + math.floor(free.get("GPU", 0.0) / gpus + 1e-9)
        if cpus > 0:
            return held + math.floor(free.get("CPU", 0.0) / cpus + 1e-9)
        return self.spec.replicas.max

    def _running(self) -> list[_Replica]:
        return [r for r in self.replicas.values() if not r.draining]

    def _scale_out(self, desired: int, capacity: int) -> None:
        from workers.actor import create_worker

        gpus, cpus = self._per_worker()
        if desired > capacity and gpus > 0:
            # Ask Ray's autoscaler (a no-op on a fixed cluster) for the whole pool.
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=[{"GPU": gpus, "CPU": cpus}] * desired)
        while len(self._running()) < desired:
            index = next(i for i in range(10_000) if i not in self.replicas)
            handle = create_worker(
                self.worker_settings(index),
                name=self.actor_name(index),
                lifetime="detached",
                namespace=self.namespace,
            )
            self.replicas[index] = _Replica(index, handle, self.clock())

    def _scale_in(self, desired: int) -> None:
        from workers.actor import retire

        for replica in sorted(self._running(), key=lambda r: -r.index)[
            : len(self._running()) - desired
        ]:
            replica.draining = True

            def drain(r: _Replica = replica) -> None:
                try:
                    retire(r.handle, timeout_s=60.0)
                except Exception:
                    ray.kill(r.handle, no_restart=True)
                finally:
                    self.replicas.pop(r.index, None)

            t = threading.Thread(target=drain, name=f"drain-{replica.index}", daemon=True)
            t.start()
            self._drains.append(t)
        self._drains = [t for t in self._drains if t.is_alive()]

    def _check_health(self) -> None:
        from ray.exceptions import GetTimeoutError, RayActorError

        from workers.actor import create_worker

        for replica in list(self._running()):
            try:
                ray.get(replica.handle.ping.remote(), timeout=_PING_TIMEOUT_S)
            except GetTimeoutError:
                continue  # busy or restarting: Ray restarts crashed actors itself
            except RayActorError:
                self.restarts += 1
                replica.handle = create_worker(
                    self.worker_settings(replica.index),
                    name=self.actor_name(replica.index),
                    lifetime="detached",
                    namespace=self.namespace,
                )
                replica.started = self.clock()

    def _measure_throughput(self, now: float) -> None:
        answered = 0
        for replica in list(self.replicas.values()):
            try:
                st = ray.get(replica.handle.status.remote(), timeout=_PING_TIMEOUT_S)
                answered += int(st.get("answered", 0)) + int(st.get("dead_lettered", 0))
            except Exception:
                continue
        if self._answered is not None and now > self._answered[0]:
            done = max(0, answered - self._answered[1])
            self.throughput = done / (now - self._answered[0])
        self._answered = (now, answered)

    def _publish_metrics(self, decision: Decision) -> None:
        from topology import metrics

        metrics.publish(
            self.spec.name,
            replicas=len(self._running()),
            desired=decision.desired,
            lag=self.lag,
            throughput=self.throughput,
            scaling=decision.changes,
        )

    def status(self) -> dict[str, Any]:
        return {
            "pipeline": self.spec.name,
            "replicas": len(self._running()),
            "draining": len(self.replicas) - len(self._running()),
            "min": self.spec.replicas.min,
            "max": self.spec.replicas.max,
            "lag": self.lag,
            "lag_error": self.lag_error or None,
            "partitions": self.partitions,
            "throughput_per_s": round(self.throughput, 3),
            "restarts": self.restarts,
            "scaling_decisions": sum(1 for d in self.decisions if d["changed"]),
            "decisions": list(self.decisions)[-10:],
            "workers": sorted(self.actor_name(i) for i in self.replicas),
        }

    def shutdown(self, drain: bool = True) -> None:
        from workers.actor import retire

        for replica in list(self.replicas.values()):
            try:
                if drain:
                    retire(replica.handle, timeout_s=60.0)
                else:
                    ray.kill(replica.handle, no_restart=True)
            except Exception:
                ray.kill(replica.handle, no_restart=True)
        self.replicas.clear()


class _ControllerImpl:
    """The detached actor: one `PipelineRunner` per pipeline, ticking on one thread."""

    def __init__(
        self, topology: dict[str, Any], namespace: str, environ: dict[str, str] | None = None
    ) -> None:
        topo = parse_topology(topology)
        self._topology = topo
        conn = topo.kafka.connection(environ)
        self._runners = [PipelineRunner(topo, p, conn, namespace) for p in topo.pipelines]
        self._stop = threading.Event()
        self._started = time.time()
        self._last_tick: dict[str, float] = {}
        self._errors: dict[str, str] = {}
        self._thread = threading.Thread(target=self._loop, name="controller", daemon=True)
        self._ensure_topics(conn)
        self._thread.start()

    def _ensure_topics(self, conn: KafkaConnection) -> None:
        from workers.kafka_admin import ensure_topics

        for p in self._topology.pipelines:
            n, rf = p.topics.partitions, p.topics.replication_factor
            topics = {t: n for t in p.input_topics}
            topics.update({p.output_topic: n, p.dead_letter_topic: 1})
            ensure_topics(conn, topics, replication_factor=rf)

    def _loop(self) -> None:
        due = {r.spec.name: 0.0 for r in self._runners}
        while not self._stop.is_set():
            now = time.monotonic()
            for runner in self._runners:
                name = runner.spec.name
                if now >= due[name]:
                    try:
                        runner.tick()
                        self._errors.pop(name, None)
                    except Exception as exc:  # the loop must outlive one bad tick
                        self._errors[name] = f"{type(exc).__name__}: {exc}"
                    self._last_tick[name] = time.time()
                    due[name] = now + runner.spec.autoscale.poll_interval_s
            self._stop.wait(0.2)

    def status(self) -> dict[str, Any]:
        return {
            "uptime_s": round(time.time() - self._started, 1),
            "pipelines": {
                r.spec.name: {
                    **r.status(),
                    "last_tick": self._last_tick.get(r.spec.name),
                    "error": self._errors.get(r.spec.name),
                }
                for r in self._runners
            },
        }

    def ping(self) -> str:
        return "pong"

    def shutdown(self, drain: bool = True) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=30)
        for r in self._runners:
            r.shutdown(drain)
        return self.status()


_remote: Any = ray.remote
ControllerActor: Any = _remote(num_cpus=0, max_restarts=-1, max_concurrency=4)(_ControllerImpl)


def start_controller(
    topology: dict[str, Any],
    deployment: str,
    namespace: str = DEFAULT_NAMESPACE,
    environ: dict[str, str] | None = None,
) -> Any:
    """The deployment's controller (created, or the running one). Ray must be initialized."""
    name = controller_name(deployment)
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    return ControllerActor.options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True
    ).remote(topology, namespace, environ)


def get_controller(deployment: str, namespace: str = DEFAULT_NAMESPACE) -> Any:
    return ray.get_actor(controller_name(deployment), namespace=namespace)

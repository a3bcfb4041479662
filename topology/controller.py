"""The controller of a deployment: a named, detached Ray actor that keeps every pipeline's
pool of workers sized to its backlog.

Every `autoscale.poll_interval_s` each pipeline's `PipelineRunner.tick` measures the lag,
counts the replicas that could run, decides the size (`topology.autoscaler`), applies it,
replaces dead replicas and publishes the tick's record; docs/architecture.md, "The
controller's tick", walks through the numbered steps.

Health (docs/operations.md, "Health: STALLED and FAILING"): a replica that reports itself
stalled (`workers.hosting.status`), or has stopped answering its status calls, is STALLED; one
that fails, waits for a restart, or restarts in a loop (`RestartLoops`: Ray's restarts of
its process and the controller's alike) is FAILING. `dgstream status` exits 1 while either
holds, and `dgstream_failing{cause}` counts them.
"""

from __future__ import annotations

import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray

from dgstream.topology.autoscaler import Autoscaler, Decision, Policy
from dgstream.topology.restarts import RestartBackoff
from dgstream.topology.spec import PipelineSpec, Topology, parse_topology
from dgstream.workers.hosting.status import ReplicaReport
from dgstream.workers.kafka.settings import KafkaConnection

CONTROLLER_PREFIX = "dgstream-controller"
DEFAULT_NAMESPACE = "dgstream"
# Decisions shown by `status()`: the last minute at the default 5 s poll.
_DECISIONS_IN_STATUS = 12
# Every tick's record, for `history()`: an hour at a 2 s poll (the tests'), 2.5 hours at
# the default 5 s; a record is a few hundred bytes.
_TIMELINE_KEPT = 1800
# How long a tick waits for the replicas' counters: at most this, and at most half the
# poll interval, so that a tick ends within its interval even while replicas are still
# starting (a new actor answers only after its constructor: imports, engine, group join).
_STATUS_WAIT_S = 10.0
_STATUS_WAIT_SHARE = 0.5
# A lag query (and the admin client's connection) gives up after this long: far above
# one on a healthy cluster (tens of milliseconds here), and short enough that a broker
# outage still yields a "lag unknown" decision every few seconds.
_LAG_TIMEOUT_S = 5.0
# Throughput and busy are rates over at least this span: several engine calls (a full
# 16-record batch of the tests' fake engine takes 1.6 s) and short against the scale-in
# window (20 s in the tests, 300 s by default).
_RATE_SPAN_S = 10.0
# A replica being drained gets the worker's default drain timeout
# (WorkerSettings.drain_timeout_s), plus this margin for closing its clients.
_DRAIN_TIMEOUT_S = 60.0
_DRAIN_MARGIN_S = 15.0
# After ray.kill, the actor's name is released once the GCS sees it dead (milliseconds
# to a second here); a new replica waits for the name at most this long.
_NAME_RELEASE_S = 10.0
# While the Kafka settings are refused (a wrong password, say), how often they are tried
# again: a fixed credential on the broker's side is picked up within half a minute, and
# the broker sees two login attempts a minute at most.
_KAFKA_RECHECK_S = 30.0
# A failed replica asked to end itself (so that Ray records why) is given this long before
# it is killed: the call only raises SystemExit in the actor, milliseconds.
_EXIT_WAIT_S = 10.0
# The cause codes of the health checks (`dgstream_failing{cause}`, `dgstream status`).
STALLED = "STALLED"
CRASH_LOOP = "CRASH_LOOP"


def controller_name(deployment: str) -> str:
    return f"{CONTROLLER_PREFIX}-{deployment}"


def _actor_info(handle: Any) -> dict[str, Any] | None:
    """The GCS's record of the actor behind `handle` (its "State": ALIVE, RESTARTING, DEAD
    ...; "NumRestarts": what `ray list actors --detail` and the dashboard's "Restarted"
    column show). Read through `ray._private.state` (a developer API): the public state
    API needs the dashboard, which a cluster may run without. None when it cannot tell."""
    try:
        from ray._private.state import actors

        info: dict[str, Any] = actors(actor_id=handle._actor_id.hex())
        return info or None
    except Exception:
        return None


def _ray_restarts(handle: Any) -> int | None:
    """How many times Ray has restarted the actor behind `handle` (None: unknown)."""
    info = _actor_info(handle)
    try:
        return None if info is None else int(info["NumRestarts"])
    except (KeyError, TypeError, ValueError):
        return None


@dataclass
class _Replica:
    index: int
    name: str
    handle: Any
    started: float
    draining: bool = False
    ready: bool = False  # its last status said "running"
    state: str = "starting"
    actor_id: str | None = None
    # Counters at the last status, and when it was read (None: never).
    done: int = 0
    busy_s: float = 0.0
    seen_at: float | None = None
    # A status call not answered yet (a starting or busy actor): asked again only once
    # it has answered, so calls never pile up behind a constructor.
    pending: Any = None
    # What its last report said went wrong (kept once it is dead), and the cause's code.
    error: str | None = None
    cause: str | None = None
    # Gone: when it may be started again (the restart backoff); None while it runs.
    retry_at: float | None = None
    # Its last report's stall (`workers.hosting.status.Stall.describe()`) and for how long.
    stall: str | None = None
    stalled_for_s: float = 0.0
    # When its last status call was answered (None: never, or Ray is restarting it).
    answered_at: float | None = None
    # How many times Ray had restarted its actor when last asked (None: not asked yet).
    ray_restarts: int | None = None
    started_wall: float = field(default_factory=time.time)  # when it was created (time.time)
    taken_down: bool = False  # killed by the controller: gone, whatever Ray says of it


@dataclass
class RestartLoops:
    """Restarts of each replica in a row, whoever restarted it (Ray, after its process
    died; the controller, after it stopped) and whatever ended it. `threshold` restarts with
    no healthy stretch of `healthy_after_s` between them are a restart loop: the replica is
    FAILING (CRASH_LOOP) until it has been healthy (running, no error, not stalled) that
    long in a row. "In a row" rather than "within a fixed window": a worker that loads vLLM
    takes minutes to start, so a loop of it would never fit a short window.

    Plain Python on the controller's clock (tested with a fake one)."""

    threshold: int
    healthy_after_s: float
    _count: dict[int, int] = field(default_factory=dict)
    _healthy_since: dict[int, float] = field(default_factory=dict)

    def restarted(self, index: int, n: int = 1) -> bool:
        """Replica `index` was restarted `n` more times; returns whether it is looping."""
        if n > 0:
            self._count[index] = self._count.get(index, 0) + n
            self._healthy_since.pop(index, None)
        return self.looping(index)

    def healthy(self, index: int, now: float) -> None:
        """Replica `index` reported serving; after `healthy_after_s` of it in a row its
        restarts are forgotten."""
        since = self._healthy_since.setdefault(index, now)
        if now - since >= self.healthy_after_s:
            self._count.pop(index, None)

    def unhealthy(self, index: int) -> None:
        self._healthy_since.pop(index, None)

    def restarts(self, index: int) -> int:
        return self._count.get(index, 0)

    def looping(self, index: int) -> bool:
        return self._count.get(index, 0) >= self.threshold

    def forget(self, index: int) -> None:
        """The replica was removed on purpose (scale-in)."""
        self._count.pop(index, None)
        self._healthy_since.pop(index, None)


@dataclass
class PipelineRunner:
    """The control loop of one pipeline (plain Python: the actor runs it on a thread)."""

    topology: Topology
    spec: PipelineSpec
    connection: KafkaConnection
    namespace: str
    clock: Callable[[], float] = time.monotonic
    replicas: dict[int, _Replica] = field(default_factory=dict)
    timeline: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=_TIMELINE_KEPT))
    lag: int | None = None
    lag_error: str = ""
    partitions: int = 0
    throughput: float = 0.0
    busy: float | None = None
    restarts: int = 0
    ray_restarts: int = 0  # restarts of replicas' processes by Ray, as the controller saw
    scaling_decisions: int = 0
    # Bundles this pipeline wants from Ray's autoscaler ([] = nothing beyond what it has).
    resource_request: list[dict[str, float]] = field(default_factory=list)
    topics_ready: bool = False
    setup_error: str = ""
    _adopted: bool = False
    _admin: Any = None
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _done_total: int = 0
    _busy_total: float = 0.0
    _samples: deque[tuple[float, int, float]] = field(default_factory=deque)
    _events: list[str] = field(default_factory=list)
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
        r = self.spec.restarts
        self.backoff = RestartBackoff(r.initial_backoff_s, r.max_backoff_s, r.reset_after_s)
        self.loops = RestartLoops(r.loop_restarts, r.reset_after_s)
        self._ray_restarts_now = 0  # Ray's restarts seen this tick (the restarts counter)
        # Per replica index: the cause and error of its last failure, shown while its
        # restarts are backed off (its replacement may run for a while before failing).
        self._last_failure: dict[int, tuple[str | None, str | None]] = {}

    # ------------------------------------------------------------------ settings

    def worker_settings(self, replica: int) -> Any:
        """This pipeline's replica's settings, built from its spec by the topology
        (`Topology.worker_settings`: the one path from a spec to a worker's settings)."""
        return self.topology.worker_settings(self.spec, replica, self.connection)

    def replica_prefix(self) -> str:
        from dgstream.workers.hosting.actor import replica_prefix

        return replica_prefix(self.topology.ray.deployment, self.spec.name)

    def actor_name(self, replica: int) -> str:
        """`dgstream-<deployment>.<pipeline>-<replica>` (`workers.hosting.actor.actor_name`)."""
        return f"{self.replica_prefix()}{replica}"

    def bundle(self) -> dict[str, float]:
        """What one replica asks Ray for (the resources with a positive amount)."""
        r = self.spec.resources
        out = {"GPU": float(r.gpus), "CPU": float(r.cpus), **r.custom}
        return {k: float(v) for k, v in out.items() if v > 0}

    # ------------------------------------------------------------------ the loop

    def tick(self) -> Decision:
        now, wall = self.clock(), time.time()
        self._events = []
        self._ray_restarts_now = 0
        # 0. once: topics, and the replicas a previous controller left
        self._setup()
        # 1. measure: the lag from Kafka, the replicas' counters
        self._measure_lag()
        dead = self._poll_replicas(now)
        # 2. replicas that could run
        capacity = self._capacity(dead)
        # 3. decide
        running = self._running()
        decision = self.autoscaler.decide(
            now,
            len(running),
            self.lag,
            self._partition_count(),
            capacity,
            error=self.lag_error,
            busy=self.busy,
        )
        # 4. apply
        self._want_resources(capacity, len(running))
        if decision.desired > len(running):
            self._scale_out(decision.desired)
        elif decision.desired < len(running):
            self._scale_in(decision.desired)
        # 5. health
        self._replace_dead(dead, now)
        # 6. publish
        self._record(decision, wall)
        self._publish_metrics(decision)
        return decision

    # 0 ----------------------------------------------------------------------------

    def _setup(self) -> None:
        if not self.topics_ready:
            from dgstream.workers.kafka.admin import ensure_topics

            s = self.spec
            n, rf = s.topics.partitions, s.topics.replication_factor
            topics = dict.fromkeys(s.input_topics, n)
            topics.update({s.output_topic: n, s.dead_letter_topic: 1})
            if not s.shadow:  # a shadow's routes are not acted on: it writes no route topic
                topics.update({r.topic: n for r in s.routes if r.topic not in topics})
            try:
                ensure_topics(
                    self._admin_client(), topics, replication_factor=rf, timeout_s=_LAG_TIMEOUT_S
                )
                self.topics_ready, self.setup_error = True, ""
            except Exception as exc:  # the broker may be down: try again next tick
                self._close_admin()
                self.setup_error = f"topics: {type(exc).__name__}: {exc}"
        if not self._adopted:
            # Replicas of this deployment's pipeline already running under our names (a
            # restarted controller): adopt them rather than fail on their names. Another
            # deployment's replicas of the same pipeline (an upgrade) have other names.
            prefix = self.replica_prefix()
            for entry in ray.util.list_named_actors(all_namespaces=True):
                name = entry["name"]
                if entry["namespace"] != self.namespace or not name.startswith(prefix):
                    continue
                suffix = name[len(prefix) :]
                if not suffix.isdigit() or int(suffix) in self.replicas:
                    continue
                try:
                    handle = ray.get_actor(name, namespace=self.namespace)
                except ValueError:
                    continue
                index = int(suffix)
                with self._lock:
                    self.replicas[index] = _Replica(index, name, handle, self.clock())
                self._events.append(f"adopted {name}")
            self._adopted = True

    # 1 ----------------------------------------------------------------------------

    def _admin_client(self) -> Any:
        if self._admin is None:
            from kafka import KafkaAdminClient

            ms = int(_LAG_TIMEOUT_S * 1000)
            self._admin = KafkaAdminClient(
                **self.connection.client_kwargs(
                    client_id=f"{self.connection.client_id}-controller",
                    request_timeout_ms=ms,
                    bootstrap_timeout_ms=ms,
                )
            )
        return self._admin

    def _close_admin(self) -> None:
        if self._admin is not None:
            with contextlib.suppress(Exception):
                self._admin.close()
            self._admin = None

    def _measure_lag(self) -> None:
        from dgstream.workers.kafka.admin import compute_lag, total_lag

        try:
            per_partition = compute_lag(
                self._admin_client(),
                self.spec.consumer_group,
                self.spec.input_topics,
                timeout_s=_LAG_TIMEOUT_S,
            )
            self.lag, self.lag_error = total_lag(per_partition), ""
            self.partitions = len(per_partition) or self.partitions
        except Exception as exc:  # any failure: the lag is unknown, not zero
            self._close_admin()  # a fresh client next time (the broker may come back)
            self.lag, self.lag_error = None, f"{type(exc).__name__}: {exc}"

    def _partition_count(self) -> int:
        # Before the first successful query: the partitions the spec creates.
        return self.partitions or self.spec.topics.partitions * len(self.spec.input_topics)

    def _status_wait(self) -> float:
        return min(_STATUS_WAIT_S, _STATUS_WAIT_SHARE * self.spec.autoscale.poll_interval_s)

    def _poll_replicas(self, now: float) -> set[int]:
        """Every replica's status at once; returns the indexes whose actor died."""
        with self._lock:
            reps = list(self.replicas.values())
        done = self._ask_all(reps)
        dead = {r.index for r in reps if self._read_status(r, done, now)}
        self._update_rates(now)
        for r in reps:
            if not r.draining and r.index not in dead and self._count_ray_restarts(r):
                dead.add(r.index)
        return dead

    def _count_ray_restarts(self, r: _Replica) -> bool:
        """Count the restarts Ray made of `r`'s actor since the last tick (its process died:
        Ray starts it again at once, without the controller's backoff). True when `r`
        restarts in a loop: it is then taken down with the cause and restarted by the
        controller, after its backoff (`_replace_dead`), and the Ray dashboard shows it
        DEAD with the loop as its exit detail."""
        if r.taken_down:
            return False  # Ray's last words on an actor being killed count no more
        n = _ray_restarts(r.handle)
        if n is None:
            return False
        seen, r.ray_restarts = r.ray_restarts, n
        if seen is None or n <= seen:
            return False  # the first look is the baseline (an adopted replica's past)
        self.ray_restarts += n - seen
        self._ray_restarts_now += n - seen
        self._events.append(f"Ray restarted {r.name} ({n - seen} time(s), {n} in all)")
        if not self.loops.restarted(r.index, n - seen):
            return False
        # Taken down as if found gone this tick (`_replace_dead`), even when an earlier
        # death already started its backoff: Ray restarted it meanwhile.
        r.ready, r.cause, r.error, r.retry_at = False, CRASH_LOOP, self._loop_error(r), None
        return True

    def _loop_error(self, r: _Replica) -> str:
        """What a restart loop says: how many restarts, and the last error the replica exited
        with (its actor leaves it in Ray's key-value store: `workers.hosting.actor.last_exit`)."""
        from dgstream.workers.hosting.actor import last_exit

        n = self.loops.restarts(r.index)
        text = (
            f"{CRASH_LOOP}: restarted {n} times in a row without serving "
            f"{self.loops.healthy_after_s:.0f} s"
        )
        last = last_exit(self.namespace, r.name)
        if last is not None:
            text += f"; its last exit ({max(0.0, time.time() - last[1]):.0f} s ago): {last[0]}"
        return text[:1000]

    def _exit_error(self, r: _Replica) -> str | None:
        """The error `r`'s actor last exited with, when it exited after `r` was started
        (`workers.hosting.actor.last_exit`): what a replica found dead says of itself."""
        from dgstream.workers.hosting.actor import last_exit

        last = last_exit(self.namespace, r.name)
        if last is None or last[1] < r.started_wall:
            return None
        return f"its process exited: {last[0]}"

    def _ask_all(self, reps: list[_Replica]) -> set[Any]:
        """Send each replica a status call (unless one is still out) and wait a while for
        all; returns the refs that answered."""
        for r in reps:
            if r.pending is None:
                r.pending = r.handle.report.remote()
        refs = [r.pending for r in reps]
        if not refs:
            return set()
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=self._status_wait())
        return set(ready)

    def _read_status(self, r: _Replica, done: set[Any], now: float) -> bool:
        """Update `r` from its status call's answer; True when the replica is gone for
        good (its actor died, or it stopped consuming) and not draining."""
        from ray.exceptions import ActorDiedError, RayActorError

        ref = r.pending
        if ref not in done:
            r.ready, r.state = False, "not answering"  # starting, busy, or unschedulable
            return False
        r.pending = None
        r.stall = None
        try:
            rep: ReplicaReport = ray.get(ref, timeout=0)
        except ActorDiedError:
            r.ready, r.state = False, "dead"
            self.loops.unhealthy(r.index)
            return not r.draining
        except RayActorError:  # restarting (Ray restarts a crashed worker)
            r.ready, r.state, r.answered_at = False, "restarting", None
            self.loops.unhealthy(r.index)
            return False
        except Exception as exc:
            r.ready, r.state = False, f"status failed: {type(exc).__name__}"
            return False
        # An error it reports (its Kafka login refused on its node, a batch it cannot read)
        # is shown with the state, and such a replica is not ready; nor is a stalled one.
        r.state, r.ready = rep.shown_state, rep.ready
        r.error, r.cause = rep.error, rep.cause
        r.stall, r.stalled_for_s, r.answered_at = rep.stall, rep.stalled_for_s, now
        if rep.ready:
            self.backoff.ready(r.index, now)
            self.loops.healthy(r.index, now)
        else:
            self.backoff.not_ready(r.index)
            self.loops.unhealthy(r.index)
        self._count(r, rep, now)
        return rep.done_consuming and not r.draining

    def _count(self, r: _Replica, rep: ReplicaReport, now: float) -> None:
        """Add what `r` finished and its engine time since its last report to the totals."""
        done_now, busy_now, actor_id = rep.finished, rep.engine_seconds, rep.actor_id
        same = actor_id == r.actor_id and done_now >= r.done
        if r.seen_at is not None:
            # A restarted actor counts from zero again.
            d_done = done_now - r.done if same else done_now
            d_busy = busy_now - r.busy_s if same else busy_now
            # Overlapping engine calls can count more engine time than wall time.
            self._done_total += max(0, d_done)
            self._busy_total += min(max(0.0, d_busy), max(0.0, now - r.seen_at))
        r.done, r.busy_s, r.actor_id, r.seen_at = done_now, busy_now, actor_id, now

    def _update_rates(self, now: float) -> None:
        self._samples.append((now, self._done_total, self._busy_total))
        while len(self._samples) > 2 and self._samples[1][0] <= now - _RATE_SPAN_S:
            self._samples.popleft()
        t0, done0, busy0 = self._samples[0]
        if now > t0:
            self.throughput = (self._done_total - done0) / (now - t0)
            self.busy = (self._busy_total - busy0) / (now - t0)

    # 2 ----------------------------------------------------------------------------

    def _capacity(self, dead: set[int]) -> int:
        """Replicas this pipeline could run now: what it holds plus what the free
        resources fit. A dead replica holds nothing (its resources are free, and step 5
        gives them to its replacement)."""
        need = self.bundle()
        held = sum(1 for r in self._running() if r.index not in dead)
        if not need:
            return max(held, self.spec.replicas.max)
        free = ray.available_resources()
        fits = min(math.floor(free.get(k, 0.0) / v + 1e-9) for k, v in need.items())
        return held + max(0, fits)

    def _running(self) -> list[_Replica]:
        with self._lock:
            return [r for r in self.replicas.values() if not r.draining]

    # 4 ----------------------------------------------------------------------------

    def _want_resources(self, capacity: int, running: int) -> None:
        """The bundles to ask Ray's autoscaler for: the whole pool the lag wants, while
        it exceeds what the cluster can hold (the request is cluster-wide and persistent;
        the controller sums the pipelines' and sends it when it changes)."""
        if self.lag is None or "GPU" not in self.bundle():
            return
        # The lag's size without the GPU limit.
        want, _ = self.autoscaler.recommend(self.lag, self._partition_count(), 1 << 30)
        if want > capacity:
            if len(self.resource_request) != want:
                self._events.append(f"asked Ray's autoscaler for {want} x {self.bundle()}")
            self.resource_request = [self.bundle()] * want
        elif self.resource_request and running >= want:
            self.resource_request = []

    def _start_replica(self, index: int, verb: str) -> bool:
        """Create replica `index` (a detached actor under its name) and track it; False
        (and an event) when the name is still held, by a replica being removed."""
        from dgstream.workers.hosting.actor import create_worker

        name = self.actor_name(index)
        try:
            handle = create_worker(
                self.worker_settings(index),
                name=name,
                lifetime="detached",
                namespace=self.namespace,
            )
        except ValueError as exc:
            self._events.append(f"cannot {verb} {name} yet: {exc}")
            return False
        with self._lock:
            self.replicas[index] = _Replica(index, name, handle, self.clock())
        return True

    def _scale_out(self, desired: int) -> None:
        while len(self._running()) < desired:
            with self._lock:
                index = next(i for i in range(len(self.replicas) + 1) if i not in self.replicas)
            if not self._start_replica(index, "start"):
                return

    def _scale_in(self, desired: int) -> None:
        # Those not running yet (starting, or waiting for resources) first, then the
        # highest indexes.
        running = sorted(self._running(), key=lambda r: (r.ready, -r.index))
        for replica in running[: len(running) - desired]:
            replica.draining = True
            t = threading.Thread(
                target=self._retire, args=(replica,), name=f"drain-{replica.name}", daemon=True
            )
            t.start()
            self._drains.append(t)
        self._drains = [t for t in self._drains if t.is_alive()]

    def _retire(self, replica: _Replica) -> None:
        """Drain (stop fetching, finish in flight, commit, leave the group), then remove
        the actor and wait until its name is free for a later replica."""
        from dgstream.workers.hosting.actor import forget_last_exit

        try:
            ray.get(
                replica.handle.drain.remote(_DRAIN_TIMEOUT_S),
                timeout=_DRAIN_TIMEOUT_S + _DRAIN_MARGIN_S,
            )
        except Exception:
            pass  # dead or stuck: its uncommitted work is consumed again by the others
        finally:
            with contextlib.suppress(Exception):
                ray.kill(replica.handle, no_restart=True)
            self._wait_name_free(replica.name)
            with self._lock:
                if self.replicas.get(replica.index) is replica:
                    del self.replicas[replica.index]
                    self.backoff.forget(replica.index)  # removed on purpose: no failure
                    self.loops.forget(replica.index)
                    self._last_failure.pop(replica.index, None)
            forget_last_exit(self.namespace, replica.name)

    def _wait_name_free(self, name: str) -> bool:
        deadline = time.monotonic() + _NAME_RELEASE_S
        while time.monotonic() < deadline:
            try:
                ray.get_actor(name, namespace=self.namespace)
            except ValueError:
                return True
            time.sleep(0.1)
        return False

    # 5 ----------------------------------------------------------------------------

    def _replace_dead(self, dead: set[int], now: float) -> None:
        """Start each replica that is gone again: at once after its first failure in a
        row, then after the restart backoff (`topology.restarts`)."""
        for index in sorted(dead):
            with self._lock:
                replica = self.replicas.get(index)
            if replica is None or replica.draining:
                continue
            if replica.retry_at is None:  # found gone this tick
                self._take_down(replica)
                error = replica.error or self._exit_error(replica)
                self._last_failure[index] = (replica.cause, error)
                replica.retry_at = self.backoff.failed(index, now)
                if replica.retry_at > now:
                    self._events.append(
                        f"{replica.name} restarts in {replica.retry_at - now:.0f} s "
                        f"(failure {self.backoff.failures(index)} in a row)"
                    )
            if now < replica.retry_at:
                continue
            # A dead actor's name is released; one that Ray is restarting keeps it.
            try:
                ray.get_actor(replica.name, namespace=self.namespace)
                continue
            except ValueError:
                pass
            if not self._start_replica(index, "restart"):
                continue
            self.restarts += 1
            self.loops.restarted(index)
            why = "its actor died" if replica.state == "dead" else f"it was {replica.state}"
            if replica.error and replica.error not in why:
                why += f" ({replica.error})"
            self._events.append(f"restarted {replica.name}: {why}"[:1000])

    def _take_down(self, replica: _Replica) -> None:
        """Remove a replica that is alive but no longer consuming, or that restarts in a
        loop (whatever state Ray has it in: the controller takes it over from Ray's
        restarts). One that failed with a reason is asked to end itself with it, so that
        Ray records the reason as its death cause (the dashboard shows it while the replica
        waits for its restart)."""
        if replica.state == "dead" and replica.cause != CRASH_LOOP:
            return
        replica.taken_down = True
        if replica.error:
            from dgstream.workers.hosting.actor import order_exit

            # An incarnation in a crash loop may die before the call below reaches it: it
            # then ends itself with the cause the next time its worker fails.
            order_exit(self.namespace, replica.name, replica.handle._actor_id.hex(), replica.error)
        deadline = time.monotonic() + _EXIT_WAIT_S
        while replica.error and time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # it dies: the call fails, as it should
                ray.get(
                    replica.handle.exit_failed.remote(replica.error),
                    timeout=max(0.1, deadline - time.monotonic()),
                )
            # A replica in a restart loop may die of its own before the call runs (the
            # call then fails too): ask its next incarnation, until Ray says it is DEAD.
            info = _actor_info(replica.handle)
            if info is None or info.get("State") == "DEAD":
                break
        with contextlib.suppress(Exception):
            ray.kill(replica.handle, no_restart=True)
        self._wait_name_free(replica.name)

    def failing(self) -> list[dict[str, Any]]:
        """The replicas that are not healthy, each with its state, cause and error:
        FAILING ones (they report an error, wait for a restart, were restarted after
        failing twice or more in a row, or restart in a loop, and have not served long
        enough since: the restarts' reset window), then STALLED ones (running without
        progress, or not answering their status calls, for the pipeline's stall_after_s).
        `dgstream status` exits 1 while this is not empty."""
        now = self.clock()
        with self._lock:
            reps = sorted(self.replicas.values(), key=lambda r: r.index)
        out = []
        for r in reps:
            if r.draining:
                continue
            entry = self._failing_entry(r, now) or self._stalled_entry(r, now)
            if entry is not None:
                out.append(entry)
        return out

    def _failing_entry(self, r: _Replica, now: float) -> dict[str, Any] | None:
        waiting = r.retry_at is not None and r.retry_at > now
        failures = self.backoff.failures(r.index)
        looping = self.loops.looping(r.index)
        if not (r.error or waiting or failures >= 2 or looping):
            return None
        cause, error = (
            (r.cause, r.error) if r.error else self._last_failure.get(r.index, (None, None))
        )
        if looping and cause is None:  # no code of its own (a batch it cannot read)
            cause, error = CRASH_LOOP, self._loop_error(r)
        return {
            "replica": r.name,
            "state": "FAILING",
            "cause": cause or ("WORKER_ERROR" if error else CRASH_LOOP),
            "error": error,
            "failures": failures,
            "restarts_in_a_row": self.loops.restarts(r.index),
            "restart_in_s": round(r.retry_at - now, 1) if waiting and r.retry_at else None,
        }

    def _stalled_entry(self, r: _Replica, now: float) -> dict[str, Any] | None:
        if r.stall:
            error, for_s = r.stall, r.stalled_for_s
        elif (
            r.pending is not None
            and r.answered_at is not None
            and now - r.answered_at >= self.spec.stall_after_s
        ):
            # Its actor is alive (Ray would say otherwise) but none of its threads answers:
            # a process that hangs, or one stopped by a signal.
            for_s = now - r.answered_at
            error = f"not answering its status calls for {for_s:.0f} s"
        else:
            return None
        return {
            "replica": r.name,
            "state": STALLED,
            "cause": STALLED,
            "error": f"{STALLED}: {error}",
            "stalled_for_s": round(for_s, 1),
            "failures": self.backoff.failures(r.index),
            "restarts_in_a_row": self.loops.restarts(r.index),
            "restart_in_s": None,
        }

    # 6 ----------------------------------------------------------------------------

    def _record(self, decision: Decision, wall: float) -> None:
        running = self._running()
        with self._lock:
            draining = len(self.replicas) - len(running)
        record = {
            "time": wall,  # when the tick started (and measured)
            "tick_s": round(time.time() - wall, 3),
            "current": decision.current,
            "desired": decision.desired,
            "replicas": len(running),
            "ready": sum(1 for r in running if r.ready),
            "draining": draining,
            "lag": decision.lag,
            "recommendation": decision.recommendation,
            "needed": decision.needed,
            "throughput_per_s": round(self.throughput, 3),
            "busy": None if self.busy is None else round(self.busy, 3),
            "reason": decision.reason,
            "changed": decision.changes,
            "events": list(self._events),
            "failing": sorted({f["cause"] for f in self.failing()}),
        }
        if decision.changes:
            self.scaling_decisions += 1
        self.timeline.append(record)

    def _publish_metrics(self, decision: Decision) -> None:
        from dgstream.topology import metrics

        running = self._running()
        metrics.publish(
            self.spec.name,
            replicas=len(running),
            ready=sum(1 for r in running if r.ready),
            desired=decision.desired,
            lag=self.lag,
            throughput=self.throughput,
            busy=self.busy,
            scaling=decision.changes,
            # The controller's restarts and Ray's alike: a worker started again.
            restarts=sum(1 for e in self._events if e.startswith("restarted"))
            + self._ray_restarts_now,
            failing=[f["cause"] for f in self.failing()],
        )

    def status(self) -> dict[str, Any]:
        running = self._running()
        with self._lock:
            reps = sorted(self.replicas.values(), key=lambda r: r.index)
        recent = list(self.timeline)[-_DECISIONS_IN_STATUS:]
        failing = self.failing()
        states = {f["state"] for f in failing}
        return {
            "pipeline": self.spec.name,
            "shadow": self.spec.shadow,
            "replicas": len(running),
            "ready": sum(1 for r in running if r.ready),
            "draining": len(reps) - len(running),
            "min": self.spec.replicas.min,
            "max": self.spec.replicas.max,
            "lag": self.lag,
            "lag_error": self.lag_error or None,
            "partitions": self.partitions,
            "throughput_per_s": round(self.throughput, 3),
            "busy": None if self.busy is None else round(self.busy, 3),
            "restarts": self.restarts,
            "ray_restarts": self.ray_restarts,
            "scaling_decisions": self.scaling_decisions,
            "resource_request": list(self.resource_request),
            "setup_error": self.setup_error or None,
            # "failing" while a replica is FAILING, else "stalled" while one is STALLED.
            "health": "failing" if "FAILING" in states else "stalled" if states else "ok",
            # The replicas that are FAILING or STALLED, with the cause, the error and the
            # backoff (`dgstream status` exits 1 while this is not empty).
            "failing": failing,
            "decisions": recent,
            "workers": [r.name for r in reps],
            "worker_states": {
                r.name: "draining" if r.draining and r.state == "running" else r.state for r in reps
            },
        }

    def history(self) -> list[dict[str, Any]]:
        return list(self.timeline)

    def shutdown(self, drain: bool = True) -> None:
        """Drain (or stop) every replica at once, then remove them."""
        with self._lock:
            reps = list(self.replicas.values())
        if drain:
            refs = [r.handle.drain.remote(_DRAIN_TIMEOUT_S) for r in reps if not r.draining]
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=_DRAIN_TIMEOUT_S + _DRAIN_MARGIN_S)
        from dgstream.workers.hosting.actor import forget_last_exit

        for r in reps:
            forget_last_exit(self.namespace, r.name)
            if drain and r.draining:
                continue  # its drain thread removes it when done
            with contextlib.suppress(Exception):
                ray.kill(r.handle, no_restart=True)
        for t in self._drains:
            t.join(timeout=_DRAIN_TIMEOUT_S + _DRAIN_MARGIN_S + _NAME_RELEASE_S)
        with self._lock:
            self.replicas.clear()
        self._close_admin()


class _ControllerImpl:
    """The detached actor: one `PipelineRunner` per pipeline, ticking on one thread.

    Its arguments hold no secret: the topology's Kafka section names the variables, read
    from this node's environment (and each worker's, on its own node)."""

    def __init__(self, topology: dict[str, Any], namespace: str) -> None:
        topo = parse_topology(topology)
        self._topology = topo
        self._runners = [PipelineRunner(topo, p, topo.kafka, namespace) for p in topo.pipelines]
        # None: not checked yet; False: refused (errors["kafka"] says why); True: usable.
        self._kafka_ok: bool | None = None
        self._stop = threading.Event()
        self._started = time.time()
        self._last_tick: dict[str, float] = {}
        self._errors: dict[str, str] = {}
        # None: not sent yet; the first loop sends what the pipelines want, which also
        # replaces a request a previous controller of this deployment left.
        self._requested: list[dict[str, float]] | None = None
        self._thread = threading.Thread(target=self._loop, name="controller", daemon=True)
        self._thread.start()

    def _kafka_usable(self) -> bool:
        """Whether the topology's Kafka settings work from this node: checked before the
        first tick, and again every `_KAFKA_RECHECK_S` while a retry cannot have helped
        (a wrong password, an untrusted certificate, a missing variable). No replica is
        started meanwhile. Unreachable is not refused: the broker may be starting, and
        the ticks say the lag is unknown."""
        from dgstream.workers.kafka.probe import KafkaConnectError, check_connection

        if self._kafka_ok:
            return True
        try:
            check_connection(self._topology.kafka, timeout_s=_LAG_TIMEOUT_S)
        except KafkaConnectError as exc:
            if exc.fatal:
                self._errors["kafka"] = str(exc)
                self._kafka_ok = False
                return False
        self._errors.pop("kafka", None)
        self._kafka_ok = True
        return True

    def _loop(self) -> None:
        due = {r.spec.name: 0.0 for r in self._runners}
        while not self._stop.is_set():
            if not self._kafka_usable():
                self._stop.wait(_KAFKA_RECHECK_S)
                continue
            for runner in self._runners:
                name = runner.spec.name
                now = time.monotonic()
                if now >= due[name] and not self._stop.is_set():
                    try:
                        runner.tick()
                        self._errors.pop(name, None)
                    except Exception as exc:  # the loop must outlive one bad tick
                        self._errors[name] = f"{type(exc).__name__}: {exc}"
                    self._last_tick[name] = time.time()
                    due[name] = now + runner.spec.autoscale.poll_interval_s
            self._sync_resource_request()
            self._stop.wait(0.1)

    def _sync_resource_request(self, clear: bool = False) -> None:
        """One cluster-wide request for every pipeline's bundles, sent when it changes."""
        bundles = [] if clear else [b for r in self._runners for b in r.resource_request]
        if bundles == self._requested:
            return
        try:
            from ray.autoscaler.sdk import request_resources

            request_resources(bundles=bundles)
            self._requested = bundles
        except Exception as exc:
            self._errors["resource_request"] = f"{type(exc).__name__}: {exc}"

    def status(self) -> dict[str, Any]:
        return {
            "uptime_s": round(time.time() - self._started, 1),
            # The settings as named (never a password), and whether they were checked.
            "kafka": self._topology.kafka.public(),
            "kafka_checked": self._kafka_ok is not None,
            "resource_request": list(self._requested or []),
            "errors": dict(self._errors),
            "pipelines": {
                r.spec.name: {
                    **r.status(),
                    "last_tick": self._last_tick.get(r.spec.name),
                    "error": self._errors.get(r.spec.name),
                }
                for r in self._runners
            },
        }

    def history(self, pipeline: str | None = None) -> dict[str, list[dict[str, Any]]]:
        """Every tick's record kept (time, lag, replicas, throughput, decision, reason)."""
        return {
            r.spec.name: r.history()
            for r in self._runners
            if pipeline is None or r.spec.name == pipeline
        }

    def ping(self) -> str:
        return "pong"

    def shutdown(self, drain: bool = True) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=60)
        for r in self._runners:
            r.shutdown(drain)
        self._sync_resource_request(clear=True)
        return self.status()


_remote: Any = ray.remote
# num_cpus=0: the controller sleeps most of the time and must never take a worker's CPU
# slot; max_restarts=-1: a crashed controller comes back and adopts its replicas;
# max_concurrency: status()/history() answer while shutdown() drains.
ControllerActor: Any = _remote(num_cpus=0, max_restarts=-1, max_concurrency=4)(_ControllerImpl)


def start_controller(
    topology: dict[str, Any], deployment: str, namespace: str = DEFAULT_NAMESPACE
) -> Any:
    """The deployment's controller (created, or the running one). Ray must be initialized.

    The passwords the topology's Kafka section names are read from the environment of
    the node the controller runs on (and of each worker's node), never sent from here."""
    name = controller_name(deployment)
    try:
        return ray.get_actor(name, namespace=namespace)
    except ValueError:
        pass
    return ControllerActor.options(
        name=name, namespace=namespace, lifetime="detached", get_if_exists=True
    ).remote(topology, namespace)


def get_controller(deployment: str, namespace: str = DEFAULT_NAMESPACE) -> Any:
    return ray.get_actor(controller_name(deployment), namespace=namespace)


def stop_controller(handle: Any, *, drain: bool = True, timeout_s: float = 120.0) -> Any:
    """Shut the controller down (its replicas drained or stopped), then remove it;
    returns its last status (None when it did not answer)."""
    try:
        return ray.get(handle.shutdown.remote(drain), timeout=timeout_s)
    except Exception:
        return None
    finally:
        with contextlib.suppress(Exception):
            ray.kill(handle, no_restart=True)

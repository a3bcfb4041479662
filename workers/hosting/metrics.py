"""The worker's metrics: Ray's (`ray.util.metrics`, exported to Prometheus and the Ray
dashboard) when the worker runs under Ray, and always a local copy that `status()` reports.

Every series is tagged with `pipeline` and `worker`; dead letters add `code`, lag adds
`partition` ("<topic>-<n>"), routed results add `route` (a route's name, "default" or
"reply"), and `dgstream_worker_state` adds `state` (1 for the state the worker is in,
"stalled" and "failed" included; 0 for the others). Outside Ray (`ray.is_initialized()`
false: unit tests, the benchmark) only the local copy is kept, so nothing here needs a
cluster.

Each counter is written by one thread only (consumer thread or engine loop), so the local
copy needs no lock under the GIL; readers take a snapshot. The state is set on status
reads, which Ray runs on several threads: it takes a lock.
"""

from __future__ import annotations

import threading
from collections import Counter as _Tally
from collections.abc import Iterable
from typing import Any

__all__ = ["WORKER_STATES", "WorkerMetrics"]

_BASE_TAGS = ("pipeline", "worker")
# The values of `dgstream_worker_state`'s `state` tag: `workers.hosting.worker.WorkerState`'s, with
# "stalled" for a running worker that makes no progress (`workers.hosting.status`).
WORKER_STATES = (
    "new",
    "starting",
    "running",
    "stalled",
    "draining",
    "stopping",
    "stopped",
    "failed",
)

# Seconds. Engine calls run from about a millisecond (the fake engine, a tiny CPU model)
# to a few seconds (a full-size batch on a GPU); end-to-end adds queueing in Kafka, so its
# buckets reach further (minutes of backlog while the pool scales out).
_ENGINE_BUCKETS = [
    0.001,
    0.0025,
    0.005,
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
]
_E2E_BUCKETS = [
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
]
# Records per batch, up to Batching.max_records' ceiling.
_BATCH_BUCKETS = [1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 4096.0, 1e4]


def _ray_ready() -> bool:
    try:
        import ray
    except ImportError:  # pragma: no cover - ray is a dependency
        return False
    return bool(ray.is_initialized())


class WorkerMetrics:
    """Counters, gauges and histograms of one worker."""

    def __init__(self, pipeline: str, worker: str, *, use_ray: bool | None = None) -> None:
        self.tags = {"pipeline": pipeline, "worker": worker}
        self.consumed = 0
        self.answered = 0
        self.dead_lettered = 0
        self.dead_letter_codes: _Tally[str] = _Tally()
        self.routed: _Tally[str] = _Tally()
        self.batches = 0
        self.engine_calls = 0
        self.engine_seconds = 0.0
        self.in_flight = 0
        self.lag: dict[str, int] = {}
        self.partitions_lost = 0
        self.transactions_aborted = 0
        self.outage: str | None = None  # the kind of the outage under way
        self.outage_tries = 0
        self.producer_resets = 0
        self.registry_unverified = 0  # framed records read while the registry was away
        self.state: str | None = None  # the last state published (`set_state`)
        self._state_lock = threading.Lock()  # status reads run on several threads
        self._ray: dict[str, Any] | None = None
        if use_ray if use_ray is not None else _ray_ready():
            self._ray = self._make_ray_metrics()

    @property
    def exported(self) -> bool:
        """Whether the figures also go to Ray's metrics."""
        return self._ray is not None

    def _make_ray_metrics(self) -> dict[str, Any]:
        from ray.util.metrics import Counter, Gauge, Histogram

        def tagged(metric: Any) -> Any:
            metric.set_default_tags(self.tags)
            return metric

        return {
            "consumed": tagged(
                Counter("dgstream_consumed", "Records consumed from the input topics.", _BASE_TAGS)
            ),
            "answered": tagged(Counter("dgstream_answered", "Results produced.", _BASE_TAGS)),
            "dead_lettered": tagged(
                Counter(
                    "dgstream_dead_lettered",
                    "Records sent to the dead-letter topic, by error code.",
                    (*_BASE_TAGS, "code"),
                )
            ),
            "routed": tagged(
                Counter(
                    "dgstream_routed",
                    "Results produced, by the route that chose their topic.",
                    (*_BASE_TAGS, "route"),
                )
            ),
            "batches": tagged(Counter("dgstream_batches", "Micro-batches processed.", _BASE_TAGS)),
            "batch_size": tagged(
                Histogram(
                    "dgstream_batch_size", "Records per micro-batch.", _BATCH_BUCKETS, _BASE_TAGS
                )
            ),
            "engine_latency": tagged(
                Histogram(
                    "dgstream_engine_latency_seconds",
                    "Wall time of one batch's classification (retries and splits included).",
                    _ENGINE_BUCKETS,
                    _BASE_TAGS,
                )
            ),
            "e2e_latency": tagged(
                Histogram(
                    "dgstream_end_to_end_latency_seconds",
                    "From the input record's timestamp to its output being sent.",
                    _E2E_BUCKETS,
                    _BASE_TAGS,
                )
            ),
            "in_flight": tagged(
                Gauge("dgstream_in_flight_batches", "Batches between poll and commit.", _BASE_TAGS)
            ),
            "partitions_lost": tagged(
                Counter(
                    "dgstream_partitions_lost",
                    "Partitions taken from this member without a revocation (it was fenced).",
                    _BASE_TAGS,
                )
            ),
            "outage": tagged(
                Gauge(
                    "dgstream_outage",
                    "1 while the engine or the output is out of reach (work held, retried).",
                    (*_BASE_TAGS, "kind"),
                )
            ),
            "outage_tries": tagged(
                Counter(
                    "dgstream_outage_tries",
                    "Tries that met an outage (each followed by a backoff pause).",
                    (*_BASE_TAGS, "kind"),
                )
            ),
            "registry_unverified": tagged(
                Counter(
                    "dgstream_registry_unverified",
                    "Framed records read without a schema id check: the registry was away.",
                    _BASE_TAGS,
                )
            ),
            "transactions_aborted": tagged(
                Counter(
                    "dgstream_transactions_aborted",
                    "Open transactions aborted by the worker (their work is read again).",
                    _BASE_TAGS,
                )
            ),
            "state": tagged(
                Gauge(
                    "dgstream_worker_state",
                    "1 for the state the worker is in (stalled: running without progress), "
                    "0 for the others.",
                    (*_BASE_TAGS, "state"),
                )
            ),
            "lag": tagged(
                Gauge(
                    "dgstream_partition_lag",
                    "High watermark minus committed offset, per assigned partition.",
                    (*_BASE_TAGS, "partition"),
                )
            ),
        }

    # ------------------------------------------------------------------ recording

    def record_consumed(self, n: int) -> None:
        if n <= 0:
            return
        self.consumed += n
        if self._ray:
            self._ray["consumed"].inc(n)

    def record_batch(self, size: int) -> None:
        self.batches += 1
        if self._ray:
            self._ray["batches"].inc()
            self._ray["batch_size"].observe(size)

    def record_engine(self, seconds: float, calls: int) -> None:
        self.engine_calls += calls
        self.engine_seconds += seconds
        if self._ray:
            self._ray["engine_latency"].observe(seconds)

    def record_outputs(
        self, answered: int, dead_codes: list[str], e2e_seconds: list[float]
    ) -> None:
        self.answered += answered
        self.dead_lettered += len(dead_codes)
        self.dead_letter_codes.update(dead_codes)
        if self._ray:
            if answered:
                self._ray["answered"].inc(answered)
            for code, n in _Tally(dead_codes).items():
                self._ray["dead_lettered"].inc(n, tags={"code": code})
            hist = self._ray["e2e_latency"]
            for s in e2e_seconds:
                hist.observe(max(s, 0.0))

    def record_routes(self, routes: Iterable[str]) -> None:
        """The route of each result produced (`workers.routes.Router`'s match names)."""
        tally = _Tally(routes)
        self.routed.update(tally)
        if self._ray:
            for route, n in tally.items():
                self._ray["routed"].inc(n, tags={"route": route})

    def record_lost(self, partitions: int) -> None:
        self.partitions_lost += partitions
        if self._ray and partitions:
            self._ray["partitions_lost"].inc(partitions)

    def record_aborted(self) -> None:
        self.transactions_aborted += 1
        if self._ray:
            self._ray["transactions_aborted"].inc()

    def record_outage_try(self, kind: str) -> None:
        self.outage_tries += 1
        if self._ray:
            self._ray["outage_tries"].inc(tags={"kind": kind})
            if self.outage != kind:
                if self.outage is not None:
                    self._ray["outage"].set(0, tags={"kind": self.outage})
                self._ray["outage"].set(1, tags={"kind": kind})
        self.outage = kind

    def record_registry_unverified(self) -> None:
        self.registry_unverified += 1
        if self._ray:
            self._ray["registry_unverified"].inc()

    def record_producer_reset(self) -> None:
        self.producer_resets += 1

    def record_outage_over(self) -> None:
        if self._ray and self.outage is not None:
            self._ray["outage"].set(0, tags={"kind": self.outage})
        self.outage = None

    def set_in_flight(self, n: int) -> None:
        if n == self.in_flight:
            return
        self.in_flight = n
        if self._ray:
            self._ray["in_flight"].set(n)

    def set_lag(self, lag: dict[str, int]) -> None:
        """Lag of the partitions assigned now; those no longer assigned drop to 0 (their
        new owner reports them)."""
        gone = set(self.lag) - set(lag)
        self.lag = lag
        if self._ray:
            gauge = self._ray["lag"]
            for partition in gone:
                gauge.set(0, tags={"partition": partition})
            for partition, value in lag.items():
                gauge.set(value, tags={"partition": partition})

    def set_state(self, state: str) -> None:
        """The worker's state as operators see it (one of WORKER_STATES): its series goes to
        1 and the previous state's to 0. Called on every status read (the controller's
        poll), so it changes within one poll of the worker."""
        with self._state_lock:  # the gauge's writes too: two readers must not cross
            if state == self.state:
                return
            previous, self.state = self.state, state
            if self._ray:
                gauge = self._ray["state"]
                if previous is None:  # the first time: every other state's series at 0
                    for other in WORKER_STATES:
                        if other != state:
                            gauge.set(0, tags={"state": other})
                else:
                    gauge.set(0, tags={"state": previous})
                gauge.set(1, tags={"state": state})

    # ------------------------------------------------------------------ reading

    def snapshot(self) -> dict[str, Any]:
        return {
            "consumed": self.consumed,
            "answered": self.answered,
            "dead_lettered": self.dead_lettered,
            "dead_letter_codes": dict(self.dead_letter_codes),
            "routed": dict(self.routed),
            "batches": self.batches,
            "engine_calls": self.engine_calls,
            "engine_seconds": round(self.engine_seconds, 6),
            "in_flight": self.in_flight,
            "lag": dict(self.lag),
            "partitions_lost": self.partitions_lost,
            "transactions_aborted": self.transactions_aborted,
            "outage_tries": self.outage_tries,
            "producer_resets": self.producer_resets,
            "registry_unverified": self.registry_unverified,
        }

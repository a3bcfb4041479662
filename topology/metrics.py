"""The controller's metrics in Ray's metrics system (shown by the Ray dashboard and its
Prometheus endpoint, where Ray prefixes each name with `ray_`); no-ops outside Ray.

Per pipeline (tag `pipeline`): replicas, ready replicas, desired replicas, group lag (left
unchanged while unknown, with `dgstream_lag_known` at 0), throughput, busy replicas'
worth of engine time; counters of scaling decisions and of replicas restarted; and
`dgstream_failing` (tags `pipeline`, `cause`): how many replicas fail with that cause (a
batch they cannot read: UNSUPPORTED_CODEC, CORRUPT_BATCH, UNDECODABLE_BATCH; WORKER_ERROR,
CRASH_LOOP), 0 once it has cleared.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

_METRICS: dict[str, Any] = {}
# Per pipeline, the causes `dgstream_failing` was set for: set to 0 once they clear.
_CAUSES_SHOWN: dict[str, set[str]] = {}


def _metric(
    kind: str, name: str, description: str, tag_keys: tuple[str, ...] = ("pipeline",)
) -> Any:
    """The process's one `ray.util.metrics` Gauge or Counter of that name (made once)."""
    if name not in _METRICS:
        from ray.util import metrics

        _METRICS[name] = getattr(metrics, kind)(name, description=description, tag_keys=tag_keys)
    return _METRICS[name]


def _gauge(name: str, description: str) -> Any:
    return _metric("Gauge", name, description)


def _counter(name: str, description: str) -> Any:
    return _metric("Counter", name, description)


def publish(
    pipeline: str,
    *,
    replicas: int,
    desired: int,
    lag: int | None,
    throughput: float,
    scaling: bool,
    ready: int | None = None,
    busy: float | None = None,
    restarts: int = 0,
    failing: Sequence[str] = (),
) -> None:
    import ray

    if not ray.is_initialized():
        return
    tags = {"pipeline": pipeline}
    _gauge("dgstream_replicas", "running workers of the pipeline").set(replicas, tags)
    _gauge("dgstream_desired_replicas", "the autoscaler's size").set(desired, tags)
    if ready is not None:
        _gauge("dgstream_ready_replicas", "workers that report running").set(ready, tags)
    _gauge("dgstream_lag_known", "1 when the last lag query succeeded").set(
        0 if lag is None else 1, tags
    )
    if lag is not None:
        _gauge("dgstream_group_lag", "end offset - committed offset, summed").set(lag, tags)
    _gauge("dgstream_throughput", "requests finished per second").set(throughput, tags)
    if busy is not None:
        _gauge("dgstream_busy_replicas", "engine-seconds per second over the pool").set(busy, tags)
    if scaling:
        _counter("dgstream_scaling_decisions", "size changes").inc(1, tags)
    if restarts:
        _counter("dgstream_replica_restarts", "dead workers started again").inc(restarts, tags)
    _publish_failing(pipeline, Counter(failing))


def _publish_failing(pipeline: str, counts: Counter[str]) -> None:
    gauge = _metric(
        "Gauge",
        "dgstream_failing",
        "replicas failing with this cause (0 once it has cleared)",
        ("pipeline", "cause"),
    )
    shown = _CAUSES_SHOWN.setdefault(pipeline, set())
    for cause in shown | set(counts):
        gauge.set(counts.get(cause, 0), {"pipeline": pipeline, "cause": cause})
    shown.update(counts)

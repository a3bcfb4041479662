"""The controller's metrics in Ray's metrics system (shown by the Ray dashboard and its
Prometheus endpoint); no-ops outside Ray."""

from __future__ import annotations

from typing import Any

_GAUGES: dict[str, Any] = {}
_COUNTERS: dict[str, Any] = {}


def _gauge(name: str, description: str) -> Any:
    if name not in _GAUGES:
        from ray.util.metrics import Gauge

        _GAUGES[name] = Gauge(name, description=description, tag_keys=("pipeline",))
    return _GAUGES[name]


def publish(
    pipeline: str,
    *,
    replicas: int,
    desired: int,
    lag: int | None,
    throughput: float,
    scaling: bool,
) -> None:
    import ray

    if not ray.is_initialized():
        return
    tags = {"pipeline": pipeline}
    _gauge("dgstream_replicas", "running workers of the pipeline").set(replicas, tags)
    _gauge("dgstream_desired_replicas", "the autoscaler's size").set(desired, tags)
    if lag is not None:
        _gauge("dgstream_group_lag", "end offset - committed offset, summed").set(lag, tags)
    _gauge("dgstream_throughput", "requests finished per second").set(throughput, tags)
    if scaling:
        if "decisions" not in _COUNTERS:
            from ray.util.metrics import Counter

            _COUNTERS["decisions"] = Counter(
                "dgstream_scaling_decisions", description="size changes", tag_keys=("pipeline",)
            )
        _COUNTERS["decisions"].inc(1, tags)

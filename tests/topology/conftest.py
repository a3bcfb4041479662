"""Fixtures of the controller tests: Ray clusters of our own (token authentication on),
each for one test module.

The scenario, its Ray clusters and the request/reader helpers are the benchmark harness's
(`bench/harness/spike.py`, `ray_cluster.py`, `pipeline.py`): the benchmark runs the same
spike and draws its timeline.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[Any]:
    """One node declaring 8 (fake) GPUs and the machine's 2 CPUs."""
    from bench.harness.ray_cluster import ray_cluster
    from bench.harness.spike import GPUS

    with ray_cluster([{"num_cpus": 2, "num_gpus": GPUS}]) as c:
        yield c


@pytest.fixture(scope="module")
def three_node_cluster() -> Iterator[Any]:
    """Three nodes, one (fake) GPU each, each naming itself with a custom resource; the
    dashboard on (on loopback) for Ray's state API."""
    from bench.harness.ray_cluster import ray_cluster

    nodes = [{"num_cpus": 1, "num_gpus": 1, "resources": {f"node-{x}": 1}} for x in ("a", "b", "c")]
    with ray_cluster(nodes, dashboard=True) as c:
        yield c

"""Fixtures of the controller tests: Ray clusters of our own (token authentication on),
each for one test module.

The scenario and its helpers live in test support (`tests/support/`: the benchmark runs the
same spike and draws its timeline); the request/reader helpers in
`tests/workers/worker_helpers.py`, whose directory goes on `sys.path` here.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
for _p in (ROOT, ROOT / "tests" / "workers"):
    if str(_p) not in sys.path:
        sys.path.insert(0, str(_p))


@pytest.fixture(scope="module")
def gpu_cluster() -> Iterator[Any]:
    """One node declaring 8 (fake) GPUs and the machine's 2 CPUs."""
    from support.ray_cluster import ray_cluster
    from support.spike import GPUS

    with ray_cluster([{"num_cpus": 2, "num_gpus": GPUS}]) as c:
        yield c


@pytest.fixture(scope="module")
def three_node_cluster() -> Iterator[Any]:
    """Three nodes, one (fake) GPU each, each naming itself with a custom resource; the
    dashboard on (on loopback) for Ray's state API."""
    from support.ray_cluster import ray_cluster

    nodes = [{"num_cpus": 1, "num_gpus": 1, "resources": {f"node-{x}": 1}} for x in ("a", "b", "c")]
    with ray_cluster(nodes, dashboard=True) as c:
        yield c

"""Fixtures of the stream-worker tests: a test pipeline's topics, worker threads, and a local
Ray cluster for the session. The helpers themselves live in
`bench/harness/pipeline.py` (the benchmarks drive the same pipelines)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from bench.harness.pipeline import INPUT_PARTITIONS, Pipeline, WorkerThread
from dgstream.workers.kafka.settings import KafkaConnection


@pytest.fixture
def pipeline(
    kafka_connection: KafkaConnection, unique_name: Callable[[str], str]
) -> Iterator[Pipeline]:
    p = Pipeline.create(kafka_connection, unique_name, INPUT_PARTITIONS)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def one_partition(
    kafka_connection: KafkaConnection, unique_name: Callable[[str], str]
) -> Iterator[Pipeline]:
    """A pipeline whose topics have one partition each: the records' order is the test's."""
    p = Pipeline.create(kafka_connection, unique_name, 1, 1)
    try:
        yield p
    finally:
        p.close()


@pytest.fixture
def worker_threads() -> Iterator[list[WorkerThread]]:
    """Started worker threads are stopped at the end of the test."""
    threads: list[WorkerThread] = []
    yield threads
    for t in threads:
        if t.thread.is_alive():
            t.worker.stop()
            t.thread.join(30)


# --------------------------------------------------------------------------- Ray


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    """A local Ray cluster of our own for the module (4 logical CPUs, no dashboard).
    Not the session: the tests run in a random order, and the controller tests start
    Ray clusters of their own, which a process still connected to this one cannot.

    `address="local"` starts a new one even when another Ray instance runs on the machine,
    and its own temp dir (dgstream.topology.local_ray) keeps their files apart; `ray.shutdown()`
    stops its processes."""
    import ray

    from dgstream.topology.local_ray import private_ray_tmp

    with private_ray_tmp("dgray-") as temp_dir:
        ctx = ray.init(
            address="local",
            num_cpus=4,
            include_dashboard=False,
            namespace="dgstream-tests",
            log_to_driver=False,
            configure_logging=False,
            _temp_dir=str(temp_dir),
        )
        try:
            yield ctx
        finally:
            ray.shutdown()

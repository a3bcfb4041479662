"""The fault matrix's CI tier (bench/fault_matrix.py runs it longer): each fault under both
delivery guarantees on a broker of its own and on a 3-broker KRaft cluster, both started
from the project's jars once per session. A cell passes when every id is answered with the
fake engine's own answers for it or dead-lettered where the fault makes dead letters, with
no duplicate under exactly-once (read_committed) and at most the documented bound under
at-least-once, and the group's committed offsets reach the end offsets."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from bench.fault_matrix import DELIVERIES, FAULTS, Brokers, Size, run_cell, running_brokers

pytestmark = pytest.mark.broker

# 200 requests over 8 s a cell: a fault a third of the way in still finds two thirds of
# the traffic to recover with, and a cell takes about half a minute.
SIZE = Size(messages=200, seconds=8.0)

# The cells that run in the CI tier; the others (marked slow) run with the whole suite and
# in the benchmark.
CI_CELLS = {
    ("single", "kill9"),
    ("single", "sigstop"),
    ("single", "scaling"),
    ("single", "broker_restart"),
    ("single", "broker_sigstop"),
    ("single", "twin"),
    ("single", "poison"),
    ("single", "output_gone"),
    ("single", "transient"),
    ("single", "drain_timeout"),
    ("cluster", "leader_kill"),
    ("cluster", "broker_restart"),
    ("cluster", "broker_sigstop"),
}


def _cells() -> list[Any]:
    out = []
    for kind in ("single", "cluster"):
        for name, fault in FAULTS.items():
            if kind not in fault.brokers:
                continue
            marks = [] if (kind, name) in CI_CELLS else [pytest.mark.slow]
            out.append(pytest.param(kind, name, marks=marks, id=f"{kind}-{name}"))
    return out


@pytest.fixture(scope="session")
def matrix_single(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Brokers]:
    """A broker of the matrix's own: its faults (restarts, freezes) touch no other test."""
    with running_brokers("single", tmp_path_factory.mktemp("mx-single")) as brokers:
        yield brokers


@pytest.fixture(scope="session")
def matrix_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Brokers]:
    """Three combined KRaft nodes, started once for the session."""
    with running_brokers("cluster", tmp_path_factory.mktemp("mx-cluster")) as brokers:
        yield brokers


@pytest.mark.parametrize("delivery", DELIVERIES)
@pytest.mark.parametrize(("kind", "fault"), _cells())
def test_fault_matrix(request: pytest.FixtureRequest, kind: str, fault: str, delivery: str) -> None:
    brokers: Brokers = request.getfixturevalue(f"matrix_{kind}")
    verdict = run_cell(brokers, fault, delivery, SIZE)
    print("\n" + " | ".join(verdict.row()))
    assert not verdict.problems(), verdict

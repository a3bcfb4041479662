"""The fault matrix's CI tier (bench/fault_matrix.py runs all of it, longer): faults under
the two delivery guarantees on a broker of its own and on a 3-broker KRaft cluster, both
started from the project's jars once per session and stopped at its end. A cell passes
when every id is answered with the fake engine's own answers for it or dead-lettered where
the fault makes dead letters, with no duplicate under exactly-once (read_committed) and at
most the documented bound under at-least-once, and the group's committed offsets reach the
end offsets."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from bench.harness.fault_matrix import DELIVERIES, FAULTS, Brokers, Size, run_cell, running_brokers

pytestmark = pytest.mark.broker

# 200 requests over 8 s a cell: a fault a third of the way in still finds two thirds of
# the traffic to recover with; a cell takes 10 to 40 s on 2 cores.
SIZE = Size(messages=200, seconds=8.0)

# `make test` (CI) runs the slow tests too, so the rest of the matrix is kept out of it by
# this variable rather than by the slow marker. The CI tier: every fault on the single
# broker under exactly-once (the strict oracle: 0 duplicates), the kill -9 under
# at-least-once (its duplicate bound), the fault only the cluster has, the partition
# leader's kill -9, under at-least-once (under exactly-once it waits out the commit
# timeout, a minute and a half a cell), and rebalances with every slot taken under
# at-least-once too. 14 cells, about 6 minutes on this 2-core machine while other suites
# ran on it (7.6 with the leader's cell; the two rebalance cells since). The whole matrix:
# DGSTREAM_FAULT_MATRIX=full, or bench/fault_matrix.py.
FULL_ENV = "DGSTREAM_FAULT_MATRIX"
CI_CELLS = {
    *(("single", name, "exactly_once") for name, f in FAULTS.items() if "single" in f.brokers),
    ("single", "kill9", "at_least_once"),
    ("single", "rebalance_full", "at_least_once"),
    ("cluster", "leader_kill", "at_least_once"),
}


# Cells that found a defect not yet fixed: they run, and report it, without failing CI.
# (One cell was here until 2026-12-01: "single, twin, exactly-once" lost one id in one CI
# run. Two fixes since explain it: a fenced worker no longer fences its successor, and a
# refused transaction's offsets no longer ride with the next one. It passed every run since.)
KNOWN_DEFECTS: dict[tuple[str, str, str], str] = {}


def _cells() -> list[Any]:
    full = os.environ.get(FULL_ENV) == "full"
    out = []
    for kind in ("single", "cluster"):
        for name, fault in FAULTS.items():
            if kind not in fault.brokers:
                continue
            for delivery in DELIVERIES:
                marks: list[Any] = [pytest.mark.slow]
                known = KNOWN_DEFECTS.get((kind, name, delivery))
                if known:
                    marks.append(pytest.mark.xfail(reason=known, strict=False))
                if not full and (kind, name, delivery) not in CI_CELLS:
                    why = f"outside the CI tier ({FULL_ENV}=full or bench/fault_matrix.py)"
                    marks.append(pytest.mark.skip(reason=why))
                out.append(
                    pytest.param(kind, name, delivery, marks=marks, id=f"{kind}-{name}-{delivery}")
                )
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


@pytest.mark.parametrize(("kind", "fault", "delivery"), _cells())
def test_fault_matrix(request: pytest.FixtureRequest, kind: str, fault: str, delivery: str) -> None:
    brokers: Brokers = request.getfixturevalue(f"matrix_{kind}")
    verdict = run_cell(brokers, fault, delivery, SIZE)
    print("\n" + " | ".join(verdict.row()), verdict.phases)
    assert not verdict.problems(), verdict

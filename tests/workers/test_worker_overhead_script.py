"""bench/worker_overhead.py, run as a script from the checkout (as `make bench` runs it)
against the real broker: it prints the side-by-side rates and leaves docs/benchmarks.md
alone unless told. A checkout's benchmark: the `dgstream` command has none (an installed
wheel holds neither bench/ nor the docs it writes)."""

from __future__ import annotations

import pytest
from support.bench_scripts import ROOT, run_bench

from bench.harness.pipeline import Pipeline

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_the_worker_overhead_benchmark_runs_and_writes_only_when_told(pipeline: Pipeline) -> None:
    boot = ",".join(pipeline.conn.bootstrap_servers)
    doc = ROOT / "docs" / "benchmarks.md"
    before = doc.read_bytes()
    args = ["--bootstrap", boot, "--messages", "600", "--repeat", "1", "--no-write"]
    stdout = run_bench("bench/worker_overhead.py", *args)
    assert "stream worker" in stdout and "plain" in stdout
    assert "round by round" in stdout
    assert doc.read_bytes() == before


@pytest.mark.unit
def test_the_ratio_is_the_median_of_paired_rounds_and_a_baselines_output_reads_back() -> None:
    """The bar is read on the median of each round's worker run over the plain loop's run
    beside it (not the best of each, which may come from different minutes), and a
    baseline checkout's printed table and runs read back, in this tree's row format and
    the one before it."""
    from bench.harness import rounds

    worker, plain = (
        [1259.0, 1141.0, 1136.0, 1120.0, 930.0],
        [1109.0, 1032.0, 1469.0, 1119.0, 1152.0],
    )
    assert [round(r, 2) for r in rounds.round_ratios(worker, plain)] == [
        1.14,
        1.11,
        0.77,
        1.0,
        0.81,
    ]
    assert rounds.median_round(worker, plain) == pytest.approx(1120 / 1119)
    assert max(worker) / max(plain) < 0.9  # the best of each: another minute's runs
    name = "| stream worker (at-least-once, 64 records a batch, 2 in flight)"
    for row in (
        f"{name} | 1,428 | **0.87x** |",
        f"{name} | 1,428 | 0.86x (round by round: **0.99x**) |",
    ):
        found = rounds.WORKER_ROW.search(row)
        assert found is not None and found.group(1) == "1,428"
    runs = rounds.RUNS.search("(all runs: worker 1,411 / 1,403, same 1,641 / 1,000, echo 9 / 9)")
    assert runs is not None
    assert rounds.numbers(runs.group(1)) == [1411.0, 1403.0]
    assert rounds.numbers(runs.group(2)) == [1641.0, 1000.0]

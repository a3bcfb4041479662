"""bench/images_kafka.py at a tiny size against the real broker: both variants run, every
request is answered (the script checks it, and that the image results' audit names the
image read), the figures come out, and docs/benchmarks.md is left alone unless told."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.bench_scripts import ROOT, run_bench

from bench.harness.pipeline import Pipeline

pytestmark = [pytest.mark.broker, pytest.mark.slow]


def test_the_images_through_kafka_benchmark_runs(pipeline: Pipeline, tmp_path: Path) -> None:
    boot = ",".join(pipeline.conn.bootstrap_servers)
    doc = ROOT / "docs" / "benchmarks.md"
    before = doc.read_bytes()
    figures = tmp_path / "figures.json"
    args = ["--bootstrap", boot, "--messages", "40", "--repeat", "1", "--image-kb", "10"]
    args.append("--no-write")
    stdout = run_bench("-m", "bench.images_kafka", *args, "--json", str(figures))
    got = json.loads(figures.read_text())
    assert set(got) == {"text only", "1 JPEG"}
    for v in got.values():
        assert len(v["rates"]) == 1 and v["rates"][0] > 0 and len(v["cpu_us"]) == 1
    # A 10 KB JPEG in base64 (about 13.4 KB) more than the text's record.
    assert got["1 JPEG"]["record_bytes"] - got["text only"]["record_bytes"] > 13_000
    assert "| 1 JPEG |" in stdout and "python -m bench.images_kafka" in stdout
    assert "--bootstrap" not in stdout.split("Reproduce:")[1]
    assert doc.read_bytes() == before

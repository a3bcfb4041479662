"""The naming rule the dashboard test relies on, checked against a real Ray: a local Ray
(in a subprocess, with the dashboard, whose metrics module writes Prometheus' service
discovery file) records every dgstream metric once; its Prometheus exporter must then serve
each series that infra_helpers.Exported.series() predicts (ray_ prefix, _total on counters,
_bucket/_sum/_count on histograms), and the discovery file must sit where
infra/monitoring/prometheus.yml expects it (<temp dir>/prom_metrics_service_discovery.json)
and list the node's exporter."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from infra_helpers import ROOT, exported_metrics, load_docs

from dgstream.topology.local_ray import private_ray_tmp

pytestmark = [pytest.mark.ray, pytest.mark.slow, pytest.mark.timeout(240)]

_SCRIPT = r"""
import inspect, json, os, sys, time, urllib.request
import ray

temp_dir, metrics_port, dashboard_port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
done_path = os.path.join(temp_dir, "scraped")  # written once the driver is done
ray.init(
    address="local", num_cpus=1, include_dashboard=True, dashboard_port=dashboard_port,
    _metrics_export_port=metrics_port, _temp_dir=temp_dir, log_to_driver=False,
    configure_logging=False,
)

@ray.remote
def record():
    import dgstream.topology.metrics as controller_metrics
    from dgstream.workers.hosting.metrics import WorkerMetrics

    m = WorkerMetrics("infra-test", "w0")
    m.record_consumed(3)
    m.record_batch(3)
    m.record_engine(0.1, 1)
    m.record_outputs(2, ["bad_json"], [0.5])
    m.record_routes(["block", "default"])
    m.set_in_flight(1)
    m.set_lag({"t-0": 5})
    m.record_lost(1)
    m.record_aborted()
    m.record_outage_try("engine")
    m.record_registry_unverified()
    m.set_state("running")
    kwargs = {
        name: (
            True if "bool" in str(p.annotation)
            else ["cause"] if "Sequence" in str(p.annotation)
            else 1
        )
        for name, p in inspect.signature(controller_metrics.publish).parameters.items()
        if p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    controller_metrics.publish("infra-test", **kwargs)
    # Keep the process (and its gauges) alive until the driver has scraped them.
    deadline = time.time() + 200
    while not os.path.exists(done_path) and time.time() < deadline:
        time.sleep(0.1)
    return True

ref = record.remote()
expected = set(json.loads(sys.stdin.read()))
names, deadline = set(), time.time() + 90
while time.time() < deadline:
    text = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10).read()
    names = {
        line.split("{")[0].split(" ")[0]
        for line in text.decode().splitlines() if line and not line.startswith("#")
    }
    if expected <= names:
        break
    time.sleep(2)
sd_path = os.path.join(temp_dir, "prom_metrics_service_discovery.json")
for _ in range(30):
    if os.path.exists(sd_path):
        break
    time.sleep(1)
sd = json.loads(open(sd_path).read()) if os.path.exists(sd_path) else None
print(json.dumps({"names": sorted(names), "sd": sd}))
open(done_path, "w").close()
assert ray.get(ref, timeout=60)
ray.shutdown()
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_infra_ray_exports_the_series_the_dashboard_reads(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    expected = set().union(*(m.series() for m in exported_metrics(monkeypatch).values()))
    monkeypatch.undo()  # the stand-ins must not leak into anything else
    metrics_port, dashboard_port = _free_port(), _free_port()
    with private_ray_tmp("dginfra-") as temp_dir:  # RAY_TMPDIR for the child, too
        run = subprocess.run(
            [sys.executable, "-c", _SCRIPT, str(temp_dir), str(metrics_port), str(dashboard_port)],
            input=json.dumps(sorted(expected)),
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=220,
            check=False,
        )
    assert run.returncode == 0, run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    missing = expected - set(out["names"])
    assert not missing, f"not served by Ray's exporter: {sorted(missing)}"
    # The discovery file: file_sd format, job "ray", this node's exporter among the targets.
    assert out["sd"], "Ray wrote no prom_metrics_service_discovery.json in its temp dir"
    (group,) = out["sd"]
    assert group["labels"] == {"job": "ray"}
    assert any(t.endswith(f":{metrics_port}") for t in group["targets"]), group
    # ... and prometheus.yml reads it at Ray's default temp dir.
    cfg = load_docs(ROOT / "infra" / "monitoring" / "prometheus.yml")[0]
    files = [
        f
        for sc in cfg["scrape_configs"]
        for sd in sc.get("file_sd_configs", [])
        for f in sd["files"]
    ]
    assert f"/tmp/ray/{Path(temp_dir, 'prom_metrics_service_discovery.json').name}" in files

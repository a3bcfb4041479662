"""The second round of the compute-limited card's bisection, picked from the first.

Round one (`vllm_session.sh engines`, at 15% of the SMs, the step watch on) runs the same
reads on engines that differ in one thing each: `ctl` the product's defaults, `eager` no
torch.compile and no CUDA graphs, `emu` vLLM's emulated NVFP4 kernels in place of Humming's
(dequantised to bf16), and on a GPU with room for five, `nocg` compiled without graphs and
`full` the defaults at the whole GPU. This prints the second round's engine specs (shell
words) and, on stderr, what round one showed:

- `ctl` passed: the failure did not reproduce; push harder (10% of the SMs, four in flight).
- `eager` passed, `ctl` failed: torch.compile or the graphs. Round two splits them (`nocg`),
  and tries Inductor's SM-count-dependent choices one at a time: split reductions and combo
  kernels (`DGSTREAM_DEBUG_INDUCTOR`).
- `emu` passed, `eager` failed: Humming's NVFP4 kernels. Round two splits the MoE experts
  from the dense layers.
- all failed: neither; round two tries another attention backend and the stock read path's
  step (two steps, no async scheduling).
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

BASE = "--sizes 32 --phases plain:60 --budget-s 400"
UTIL = {"gpu_memory_utilization": 0.86}


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def failed(run: dict[str, Any] | None) -> int:
    """Failed batches of a run; -1 when it never served (no JSON)."""
    if run is None:
        return -1
    return sum(p["failed_batches"] for p in run.get("phases", []))


def spec(name: str, pct: int, knobs: dict[str, Any], env: str = "", args: str = BASE) -> str:
    """One engine of `vllm_session.sh engines`; it starts from `ctl`'s kernel caches (its
    Humming kernels were built in round one: about 90 s of a cold start)."""
    settings = json.dumps({**UTIL, **knobs}, separators=(",", ":"))
    env = ",".join(filter(None, ("CACHE_FROM=ctl", env)))
    return f"{name}:{pct}:{env}:{args} --settings {settings}"


def pick(runs: dict[str, dict[str, Any] | None], room: int) -> tuple[str, list[str]]:
    f = {name: failed(run) for name, run in runs.items()}
    why = ", ".join(f"{k} {v}" for k, v in f.items())
    if f.get("ctl") == 0:
        specs = [
            spec("p10", 10, {}),
            spec("p15x4", 15, {}, args=BASE.replace("--sizes 32", "--sizes 32 --in-flight 4")),
            spec("p25", 25, {}),
        ]
        return f"not reproduced ({why})", specs[:room]
    if f.get("eager") == 0:
        nosplit = "DGSTREAM_DEBUG_INDUCTOR=split_reductions=false"
        nocombo = "DGSTREAM_DEBUG_INDUCTOR=combo_kernels=false"
        specs = [
            spec("nocg", 15, {"cudagraph_mode": "NONE"}),
            spec("nosplit", 15, {}, env=nosplit),
            spec("nocombo", 15, {}, env=nocombo),
            spec("piece", 15, {"cudagraph_mode": "PIECEWISE", "full_graph_tokens": 0}),
            spec("eager25", 25, {"enforce_eager": True}),
        ]
        return f"compile or graphs ({why})", specs[:room]
    if f.get("emu") == 0:
        specs = [
            spec("emumoe", 15, {"moe_backend": "emulation"}),
            spec("emulin", 15, {"linear_backend": "emulation"}),
            spec("emu25", 25, {"moe_backend": "emulation", "linear_backend": "emulation"}),
        ]
        return f"Humming's kernels ({why})", specs[:room]
    specs = [
        spec("fa", 15, {"attention_backend": "FLASH_ATTN"}),
        spec(
            "two", 15, {"one_step_reads": False, "full_graph_tokens": 0, "async_scheduling": False}
        ),
        spec(
            "eageremu",
            15,
            {"enforce_eager": True, "moe_backend": "emulation", "linear_backend": "emulation"},
        ),
    ]
    return f"none of them ({why})", specs[:room]


def gpu_gib() -> float:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            check=True,
        )
        return float(out.stdout.split()[0]) / 1024
    except (OSError, ValueError, subprocess.CalledProcessError, IndexError):
        return 80.0


def room() -> int:
    """Engines of a 23.6 GiB card each that fit beside each other (one GiB each outside)."""
    return max(1, int(gpu_gib() // 24.6))


def main() -> int:
    folder = Path(sys.argv[1])
    names = ("ctl", "eager", "emu", "nocg", "full")
    runs = {
        n: _load(folder / f"soak_{n}.json") for n in names if (folder / f"soak_{n}.log").exists()
    }
    case, specs = pick(runs, room())
    print(f"next round: {case}", file=sys.stderr)
    print(" ".join(shlex.quote(s) for s in specs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

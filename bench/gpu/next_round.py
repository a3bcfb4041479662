"""The second round of the compute-limited card's bisection, picked from the first.

Round one (`vllm_session.sh engines`, at 15% of the SMs, the step watch on) runs the same
reads on engines that differ in one thing each: `ctl` the product's defaults, `eager` no
torch.compile and no CUDA graphs, `emu` vLLM's emulated NVFP4 kernels in place of Humming's
(dequantised to bf16), and on a GPU with room for five, `two` vLLM's two steps a read (no
one-step reads, whose attention ranges are the read path's own) and
`nocombo` compiled without Inductor's combo kernels (horizontal fusion, whose variants
Inductor picks by timing them on the GPU at hand). This prints the second round's engine
specs (shell words) and, on stderr, what round one showed:

- `ctl` passed: the failure did not reproduce; push harder (10% of the SMs, four in flight).
- `nocombo` passed, `ctl` failed: the fix candidate, soaked at 15%, 25% and the whole GPU;
  `two` passed: the same with two steps a read.
- `eager` passed: torch.compile or the graphs (`nocg` says which); round two tries
  Inductor's choices that depend on the GPU one at a time (`DGSTREAM_DEBUG_INDUCTOR`), or
  the graph modes.
- `emu` passed, `eager` failed: Humming's NVFP4 kernels. Round two splits the MoE experts
  from the dense layers.
- all failed: neither; round two tries another attention backend and the stock read path's
  step (two steps, no async scheduling).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

# Seconds from an engine's process start to its last new batch: what a device call leaves
# round two (NEXT_BUDGET_S; the engines start warm, from round one's kernel caches).
BUDGET_S = int(os.environ.get("NEXT_BUDGET_S", "400"))
BASE = f"--sizes 32 --phases plain:60 --budget-s {BUDGET_S}"
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


SOAK = f"--budget-s {BUDGET_S}"


def pick(runs: dict[str, dict[str, Any] | None], room: int) -> tuple[str, list[str]]:
    f = {name: failed(run) for name, run in runs.items()}
    why = ", ".join(f"{k} {v}" for k, v in f.items())
    nocombo = "DGSTREAM_DEBUG_INDUCTOR=combo_kernels=false"
    if f.get("ctl") == 0:
        specs = [
            spec("p10", 10, {}),
            spec("p15x4", 15, {}, args=BASE.replace("--sizes 32", "--sizes 32 --in-flight 4")),
            spec("p25", 25, {}),
        ]
        return f"not reproduced ({why})", specs[:room]
    if f.get("nocombo") == 0:
        # The fix candidate, soaked: every batch size, unique and shared, two in flight,
        # at 15% and 25% and (the reference for the read-by-read comparison) the whole GPU.
        specs = [
            spec("fix15", 15, {}, env=nocombo, args=SOAK),
            spec("fix25", 25, {}, env=nocombo, args=SOAK),
            spec("ref", 100, {}, env=nocombo, args=SOAK),
            spec("ctl25", 25, {}),
        ]
        return f"Inductor's combo kernels ({why})", specs[:room]
    if f.get("two") == 0:
        # The one-step reads' attention ranges: vLLM's two steps, soaked as the workaround.
        knobs = {"one_step_reads": False}
        specs = [
            spec("two15", 15, knobs, args=SOAK),
            spec("two25", 25, knobs, args=SOAK),
            spec("tworef", 100, knobs, args=SOAK),
            spec("ctl25", 25, {}),
        ]
        return f"the one-step reads ({why})", specs[:room]
    if f.get("eager") == 0:
        specs = [
            spec("nosplit", 15, {}, env="DGSTREAM_DEBUG_INDUCTOR=split_reductions=false"),
            spec("nobench", 15, {}, env="DGSTREAM_DEBUG_INDUCTOR=benchmark_combo_kernel=false"),
            spec(
                "nopersist",
                15,
                {},
                env="DGSTREAM_DEBUG_INDUCTOR=triton.persistent_reductions=false",
            ),
            spec("piece", 15, {"cudagraph_mode": "PIECEWISE", "full_graph_tokens": 0}),
            spec("eager25", 25, {"enforce_eager": True}, args=SOAK),
        ]
        if f.get("nocg") == 0:
            specs = [
                spec("piece", 15, {"cudagraph_mode": "PIECEWISE", "full_graph_tokens": 0}),
                spec("fullonly", 15, {"cudagraph_mode": "FULL"}),
                spec("nocg25", 25, {"cudagraph_mode": "NONE"}, args=SOAK),
                spec("nocgref", 100, {"cudagraph_mode": "NONE"}, args=SOAK),
            ]
            return f"CUDA graphs ({why})", specs[:room]
        return f"torch.compile ({why})", specs[:room]
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
    names = ("ctl", "eager", "emu", "two", "nocombo")
    runs = {
        n: _load(folder / f"soak_{n}.json") for n in names if (folder / f"soak_{n}.log").exists()
    }
    case, specs = pick(runs, room())
    print(f"next round: {case}", file=sys.stderr)
    print(" ".join(shlex.quote(s) for s in specs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

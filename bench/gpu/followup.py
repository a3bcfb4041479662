"""The engines of the round after the diagnosis (vllm_session.sh `followup`), picked from it.

The diagnosis round (`engines a c ref`) ran, at 15% of the SMs: `a`, batches of 32 in phases
plain / per-step sync / plain; `c`, the soak with Humming's kernels tuned for another SM
count; `ref`, the soak at full speed. This prints the next round's engine specs (shell
words, for `set --`) and, on stderr, which case it is and why:

- H: `a` failed without sync and `c` never failed -> the SM count Humming is tuned for is the
  cause: the soak at 25% with the same pin, and the slow-GPU test with the pin.
- S: `a` failed without sync, not with it, and `c` failed -> a race of the host ahead of the
  device: the soaks at 15% and 25% with per-step sync, and the test with it.
- N: nothing failed -> push harder (four batches in flight, 10% of the SMs).
- X: it failed either way (what the first run found, 2026-12-07) -> settings apart (two
  steps without FULL graphs, eager, no async scheduling), one engine each.
"""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path
from typing import Any

SOAK = "--budget-s 450"


def _load(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def failed(run: dict[str, Any] | None, phases: set[str] | None = None) -> int:
    if run is None:
        return -1
    return sum(
        p["failed_batches"] for p in run.get("phases", []) if phases is None or p["phase"] in phases
    )


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


def pick(a: dict[str, Any] | None, c: dict[str, Any] | None, gib: float) -> tuple[str, list[str]]:
    a_plain, a_sync = failed(a, {"plain", "plain2"}), failed(a, {"sync"})
    c_all = failed(c)
    pin_sms = ((c or {}).get("info") or {}).get("humming_sms") or ""
    pin = f"DGSTREAM_DEBUG_HUMMING_SMS={pin_sms}"
    why = f"a plain {a_plain}, a sync {a_sync}, c {c_all} failed batches; {gib:.0f} GiB"
    if a_plain > 0 and c_all == 0:
        specs = [
            f"d25:25:{pin},CACHE_FROM=c:{SOAK}",
            f"tfix:15:{pin},CACHE_FROM=c:pytest",
        ]
        return f"H ({why})", specs
    if a_plain > 0 and a_sync == 0:
        specs = [
            f"s15:15:CACHE_FROM=a:--phases all:0:sync {SOAK}",
            f"s25:25:CACHE_FROM=a:--phases all:0:sync {SOAK}",
            "tfix:15:DGSTREAM_READS_SYNC=1,CACHE_FROM=a:pytest",
        ]
        return f"S ({why})", specs
    if a_plain == 0 and c_all == 0:
        specs = [
            f"n15:15:CACHE_FROM=a:--sizes 32 --in-flight 4 --phases plain:400 {SOAK}",
            f"n10:10:CACHE_FROM=a:--sizes 32 --phases plain:400 {SOAK}",
            f"n25:25:CACHE_FROM=a:{SOAK}",
        ]
        return f"N ({why})", specs
    x = "CACHE_FROM=a:--sizes 32 --phases plain:120 --settings"
    apart = {
        "x_two": {"one_step_reads": False, "full_graph_tokens": 0},
        "x_eager": {"enforce_eager": True},
        "x_sync": {"async_scheduling": False},
    }
    specs = [
        f"{name}:15:{x} {json.dumps(knobs, separators=(',', ':'))} {SOAK}"
        for name, knobs in apart.items()
    ]
    return f"X ({why})", specs


def main() -> int:
    folder = Path(sys.argv[1])
    case, specs = pick(_load(folder / "soak_a.json"), _load(folder / "soak_c.json"), gpu_gib())
    print(f"followup case {case}", file=sys.stderr)
    print(" ".join(shlex.quote(s) for s in specs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

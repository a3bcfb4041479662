"""How far the host sampler of GPU runs (bench/gpu/card/dgstacks.py) puts a loop's time
where it was spent, on the CPU (the loop and the settings: bench/harness/sampler_bias.py).
Prints the table and writes docs/benchmarks.md's section.

    python bench/stacks_bias.py [--seconds 6]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.harness.sampler_bias import SETTINGS, measure, render


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--no-write", action="store_true", help="print only")
    args = ap.parse_args()
    rows = []
    for name, switch, jitter in SETTINGS:
        truth, sampled = measure(args.seconds, switch, jitter)
        rows.append((name, truth, sampled))
        print(name, {k: round(v, 1) for k, v in truth.items()}, sampled, flush=True)
    md = render(rows, args.seconds)
    print(md)
    if not args.no_write:
        from bench.report import write_section

        write_section("host-sampler", md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

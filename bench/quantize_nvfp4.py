"""Quantize the committed demo model to NVFP4 in the production checkpoint's format, and
optionally compare it with the demo model on the CPU. The quantizer and its bars live in
bench/harness/nvfp4.py (the tests check the committed checkpoint against it).

    python -m bench.quantize_nvfp4                  # writes workers/engine/weights/demo-nvfp4
    python -m bench.quantize_nvfp4 --out DIR
    python -m bench.quantize_nvfp4 --compare 300    # CPU preview, about 35 s
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.harness.nvfp4 import IGNORE, SOURCE, TARGET, cpu_preview, quantize


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", default=str(SOURCE), help="the demo checkpoint")
    p.add_argument("--out", default=str(TARGET), help="where the NVFP4 checkpoint goes")
    p.add_argument(
        "--compare",
        type=int,
        default=0,
        metavar="N",
        help="then run N held-out requests on the CPU, demo against dequantized NVFP4",
    )
    args = p.parse_args(argv)
    out = Path(args.out)
    summary = quantize(Path(args.source), out)
    print(
        f"wrote {out}: {len(summary['quantized'])} Linears in NVFP4, "
        f"{len(summary['dense'])} Linears kept dense ({', '.join(IGNORE)}); "
        f"{summary['bytes'] / 1e6:.2f} MB against {summary['source_bytes'] / 1e6:.2f} MB "
        f"in {summary['seconds']:.1f} s"
    )
    if args.compare:
        preview = cpu_preview(out, args.compare)
        print(json.dumps(preview, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())

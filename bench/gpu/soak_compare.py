"""Read-by-read comparison of soak runs (reads_soak.py): a compute-limited card's reads
against the same reads at full speed. Runs here, on the JSON.

    python bench/gpu/soak_compare.py REFERENCE.json RUN.json [RUN.json ...] [--out summary.json]

For every read both runs answered: the largest gap between the same label's logprobs
(`lp_gap`), between its probabilities (`p_gap`, each slot's softmax over its labels, what a
worker reports) and whether every slot's most likely label agrees. The tolerance is
measured, not assumed: the reference's `repeat` pass reads its first reads again in other
batches on the same engine, so `noise` is how far a read moves with its batch alone (vLLM
is not batch-invariant). `separation` is, for a sample of reads, the gap to the nearest
OTHER read of the reference: a read answered with another read's values would show a gap
that large, which is what a read-by-read check can see.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

import numpy as np

Lp = list[list[float]]


def _values(read: Any) -> Lp | None:
    """A read's per-slot label logprobs as floats (None: not recorded or not finite)."""
    if not read or read == [[None]]:
        return None
    out = []
    for slot in read:
        vals = [float(v) if v is not None else math.nan for v in slot]
        if not all(math.isfinite(v) for v in vals):
            return None
        out.append(vals)
    return out


def _probs(slot: list[float]) -> np.ndarray:
    v = np.asarray(slot, dtype=np.float64)
    e = np.exp(v - v.max())
    return e / e.sum()


def gaps(a: Lp, b: Lp) -> tuple[float, float, bool]:
    """(largest logprob gap, largest probability gap, every slot's argmax agrees)."""
    lp = max(abs(x - y) for sa, sb in zip(a, b, strict=True) for x, y in zip(sa, sb, strict=True))
    p = 0.0
    agree = True
    for sa, sb in zip(a, b, strict=True):
        pa, pb = _probs(sa), _probs(sb)
        p = max(p, float(np.abs(pa - pb).max()))
        agree &= int(pa.argmax()) == int(pb.argmax())
    return lp, p, agree


def _quantiles(xs: list[float]) -> dict[str, float]:
    if not xs:
        return {}
    a = np.asarray(xs)
    return {
        "n": len(xs),
        "p50": float(np.quantile(a, 0.5)),
        "p99": float(np.quantile(a, 0.99)),
        "p999": float(np.quantile(a, 0.999)),
        "max": float(a.max()),
    }


def noise(ref: dict[str, Any]) -> dict[str, float]:
    """How far the reference's repeated reads moved from their first pass."""
    out = []
    for tag, again in (ref.get("repeat") or {}).items():
        a, b = _values(ref["reads"].get(tag)), _values(again)
        if a is not None and b is not None:
            out.append(gaps(a, b)[0])
    return _quantiles(out)


def separation(ref: dict[str, Any], sample: int = 1000, seed: int = 0) -> dict[str, float]:
    """For `sample` reads: the logprob gap to the nearest other read of the reference."""
    tags = [t for t, r in ref["reads"].items() if _values(r) is not None]
    if len(tags) < 2:
        return {}
    flat = np.array([[v for s in _values(ref["reads"][t]) or [] for v in s] for t in tags])
    rng = np.random.default_rng(seed)
    picks = rng.choice(len(tags), size=min(sample, len(tags)), replace=False)
    nearest = []
    for i in picks:
        d = np.abs(flat - flat[i]).max(axis=1)
        d[i] = np.inf
        nearest.append(float(d.min()))
    return _quantiles(nearest)


def identity(ref: dict[str, Any], run: dict[str, Any], chunk: int = 512) -> dict[str, Any]:
    """Whether each read of the run is its own: nearer (largest logprob gap) to the same read
    of the reference than to every other reference read of its shape. A read answered with
    another read's values, the silent failure a soak looks for, is nearer to that other read
    (`misplaced`); `margin` is how much nearer each read is to itself than to any other."""
    shapes: dict[tuple[int, ...], list[tuple[str, np.ndarray, np.ndarray]]] = {}
    for tag, r in ref["reads"].items():
        a, b = _values(r), _values(run["reads"].get(tag))
        if a is None or b is None:
            continue
        shape = tuple(len(s) for s in a)
        if shape != tuple(len(s) for s in b):
            continue
        flat = [np.array([v for s in x for v in s]) for x in (a, b)]
        shapes.setdefault(shape, []).append((tag, flat[0], flat[1]))
    misplaced: list[str] = []
    margins: list[float] = []
    for items in shapes.values():
        if len(items) < 2:
            continue
        refs = np.stack([x[1] for x in items])
        runs = np.stack([x[2] for x in items])
        for lo in range(0, len(items), chunk):
            d = np.abs(runs[lo : lo + chunk, None, :] - refs[None, :, :]).max(axis=-1)
            rows = np.arange(d.shape[0])
            own = d[rows, lo + rows].copy()
            d[rows, lo + rows] = np.inf
            other = d.min(axis=1)
            margins += (other - own).tolist()
            misplaced += [items[lo + i][0] for i in np.flatnonzero(other <= own)]
    return {"checked": len(margins), "misplaced": misplaced[:50], "margin": _quantiles(margins)}


def compare(ref: dict[str, Any], run: dict[str, Any]) -> dict[str, Any]:
    lp_gaps, p_gaps = [], []
    disagree, missing, broken = 0, 0, 0
    for tag, r in ref["reads"].items():
        a = _values(r)
        if a is None:
            continue
        if tag not in run["reads"]:
            missing += 1
            continue
        b = _values(run["reads"][tag])
        if b is None:
            broken += 1
            continue
        lp, p, agree = gaps(a, b)
        lp_gaps.append(lp)
        p_gaps.append(p)
        disagree += not agree
    phases = run.get("phases", [])
    return {
        "name": (run.get("info") or {}).get("name"),
        "mps_percentage": (run.get("info") or {}).get("mps_active_thread_percentage"),
        "reads": sum(p["reads"] for p in phases),
        "failed_batches": sum(p["failed_batches"] for p in phases),
        "failed_reads": sum(p.get("failed_reads", 0) for p in phases),
        "compared": len(lp_gaps),
        "not_in_run": missing,
        "not_finite_in_run": broken,
        "answers_differ": disagree,
        "identity": identity(ref, run),
        "lp_gap": _quantiles(lp_gaps),
        "p_gap": _quantiles(p_gaps),
        "reads_per_s": [
            {"phase": p["phase"], "reads_per_s": p.get("reads_per_s"), "reads": p["reads"]}
            for p in phases
        ],
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("reference")
    ap.add_argument("runs", nargs="+")
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    ref = json.loads(Path(args.reference).read_text())
    body = {
        "reference": args.reference,
        "noise": noise(ref),
        "separation": separation(ref),
        "runs": [compare(ref, json.loads(Path(p).read_text())) for p in args.runs],
    }
    print(json.dumps(body, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(body, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Calibration on the demo model: ECE before and after `dgstream calibrate`'s temperatures,
and the share of results each route takes against its threshold.

The demo's moderation events (`topology.demo_tasks.sample_events`: fixed question ids, the
truth in each event's metadata) go through the embedded demo model on the CPU (one read
each), as the model is and as two miscalibrated variants of it, made by changing the label
logits of every read (with one read a request, the answer's distribution is the read's):

- `T=3`: the logits divided by 3 (a model too unsure of itself: what temperature scaling
  is for);
- `T=2, +1.5 yes`: divided by 2, and 1.5 added to the yes logit of every yes/no question
  (a model biased towards yes, which one temperature cannot undo).

Each variant's temperatures are fitted on one split (seed 1) with the product's own fitter
(`workers.results.calibration.fit`, what `dgstream calibrate` runs) and scored on another (seed 2):
ECE per kind and overall (15 equal-width bins over the confidence of the answer given),
then the product's router (`workers.routes.Router`) routes the scored split's results, raw
and calibrated, by two routes on `insult.p_yes`; for each route, the share of results it
takes and the share of those whose truth is an insult.

    python -m bench.calibration                 # 1000 events a split; writes docs/benchmarks.md
    python -m bench.calibration --events 200 --no-write
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.report import write_section
from dgstream.schemas import ClassificationResult, parse_request
from dgstream.schemas.result import ChoiceAnswer, ScoreAnswer, YesNoAnswer
from dgstream.topology.demo_tasks import MODERATION_QUESTIONS, sample_events
from dgstream.workers.engine.factory import EngineSettings, build_classifier
from dgstream.workers.results.calibration import Calibrator, Example, distribution, ece, fit
from dgstream.workers.routes import Route, Router

ROUTES = [
    Route(name="block", when="insult.p_yes >= 0.9", topic="mod.block"),
    Route(name="review", when="insult.p_yes >= 0.5", topic="mod.review"),
]
Distort = Callable[[np.ndarray, bool], np.ndarray]


def _tempered(t: float, yes_bias: float = 0.0) -> Distort:
    def apply(probs: np.ndarray, yes_no: bool) -> np.ndarray:
        logits = np.log(np.clip(probs, 1e-12, 1.0)) / t
        if yes_no:
            logits = logits.copy()
            logits[0] += yes_bias  # label order: yes, no
        z = np.exp(logits - logits.max())
        return z / z.sum()

    return apply


VARIANTS: dict[str, Distort | None] = {
    "demo model": None,
    "T=3": _tempered(3.0),
    "T=2, +1.5 yes": _tempered(2.0, 1.5),
}


def _answer(events: list[dict[str, Any]]) -> list[ClassificationResult]:
    """The demo model's results (one read each)."""
    classifier = build_classifier(EngineSettings(model="demo", device="cpu"))
    requests = [parse_request(json.dumps(e).encode()) for e in events]

    async def run() -> list[Any]:
        out: list[Any] = []
        for i in range(0, len(requests), 64):
            out += await classifier.classify(requests[i : i + 64])  # type: ignore[arg-type]
        return out

    results = asyncio.run(run())
    assert all(isinstance(r, ClassificationResult) and r.diagnostics.reads == 1 for r in results)
    return results


def _distorted(result: ClassificationResult, distort: Distort | None) -> ClassificationResult:
    """`result` as the miscalibrated model would answer: with one read a request, its
    answer's distribution IS the read's label softmax, so changing the label logits of the
    read and changing them here are the same."""
    if distort is None:
        return result
    answers: dict[str, Any] = {}
    for qid, a in result.answers.items():
        if isinstance(a, YesNoAnswer):
            p = float(distort(np.array([a.p_yes, 1 - a.p_yes]), True)[0])
            answers[qid] = YesNoAnswer(
                p_yes=round(p, 6),
                label="yes" if p >= 0.5 else "no",
                confidence=round(max(p, 1 - p), 6),
            )
        elif isinstance(a, ChoiceAnswer | ScoreAnswer):
            names = list(a.probabilities)
            q = distort(np.array([a.probabilities[n] for n in names]), False)
            probs = {n: round(float(v), 6) for n, v in zip(names, q, strict=True)}
            top = names[int(np.argmax(q))]
            if isinstance(a, ChoiceAnswer):
                answers[qid] = ChoiceAnswer(choice=top, probabilities=probs, confidence=probs[top])
            else:
                order = [a.legend[str(i + 1)] for i in range(len(a.legend))]
                expected = sum((i + 1) * probs[n] for i, n in enumerate(order))
                answers[qid] = ScoreAnswer(
                    expected_score=round(min(max(expected, 1.0), len(order)), 6),
                    level=top,
                    legend=a.legend,
                    probabilities=probs,
                    confidence=probs[top],
                )
        else:
            answers[qid] = a
    return result.model_copy(update={"answers": answers})


def _labelled(results: list[ClassificationResult], raw: bool) -> dict[str, list[Any]]:
    by_q: dict[str, list[Any]] = {}
    for r in results:
        truth = r.metadata["truth"]
        for qid, answer in r.answers.items():
            d = distribution(answer.model_dump(), raw=raw)
            if d is not None:
                by_q.setdefault(qid, []).append((d, truth[qid]))
    return by_q


def _ece(results: list[ClassificationResult]) -> dict[str, float]:
    """ECE per kind and overall, of the probabilities the results carry."""
    by_kind: dict[str, list[Example]] = {}
    for qid, pairs in _labelled(results, raw=False).items():
        kind = pairs[0][0].kind
        for d, t in pairs:
            by_kind.setdefault(kind, []).append(Example(d.probs, d.labels.index(t)))
        del qid
    out = {k: ece(v) for k, v in sorted(by_kind.items())}
    out["all"] = ece([e for v in by_kind.values() for e in v])
    return out


def _routes(results: list[ClassificationResult]) -> dict[str, tuple[float, float]]:
    """Route -> (share of results it takes, share of those truly insults)."""
    router = Router(ROUTES, "mod.results")
    taken: dict[str, list[bool]] = {}
    for r in results:
        taken.setdefault(router.route(r).name, []).append(r.metadata["truth"]["insult"] == "yes")
    return {
        name: (
            len(taken.get(name, [])) / len(results),
            float(np.mean(taken[name])) if taken.get(name) else 0.0,
        )
        for name in ("block", "review", "default")
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--events", type=int, default=1000, help="events in each split")
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    fit_events, score_events = (
        sample_events(args.events, seed=1),
        sample_events(args.events, seed=2),
    )
    t0 = time.perf_counter()
    rows: list[dict[str, Any]] = []
    fit_raw, score_raw = _answer(fit_events), _answer(score_events)
    for name, distort in VARIANTS.items():
        fitted = [_distorted(r, distort) for r in fit_raw]
        scored = [_distorted(r, distort) for r in score_raw]
        cal, skipped = fit(_labelled(fitted, raw=True), source=f"demo events seed 1 ({name})")
        calibrated = [Calibrator(cal).apply(r) for r in scored]
        rows.append(
            {
                "variant": name,
                "temperatures": {q: c.temperature for q, c in cal.questions.items()},
                "skipped": skipped,
                "ece_raw": _ece(scored),
                "ece_cal": _ece(calibrated),
                "routes_raw": _routes(scored),
                "routes_cal": _routes(calibrated),
            }
        )
        print(json.dumps(rows[-1]))
    seconds = time.perf_counter() - t0
    md = _markdown(rows, args.events, seconds)
    print(md)
    if not args.no_write:
        write_section("calibration", md)
    return 0


def _markdown(rows: list[dict[str, Any]], n: int, seconds: float) -> str:
    qs = list(MODERATION_QUESTIONS)
    lines = [
        "## Calibration: the demo model and two miscalibrated variants (temperature scaling)",
        "",
        f"`dgstream calibrate`'s fitter (`workers.results.calibration.fit`) on the demo's "
        f"moderation events, {n} to fit (seed 1) and {n} others to score (seed 2), through the "
        "demo model on the CPU (one read each, so an answer's distribution is its read's label "
        "softmax); the variants change every read's label logits "
        "(`T=3`: divided by 3; `T=2, +1.5 yes`: divided by 2 and 1.5 added to yes). ECE: 15 "
        f"equal-width bins over the confidence of the answer given, on the scoring split. "
        f"{seconds:.0f} s in all. Command: `python -m bench.calibration"
        + (f" --events {n}" if n != 1000 else "")
        + "`.",
        "",
        "| variant | fitted T ("
        + ", ".join(qs)
        + ") | ECE yes/no | ECE choice | ECE score | ECE all |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        temps = ", ".join(f"{r['temperatures'].get(q, float('nan')):.2f}" for q in qs)
        for label, key in (("raw", "ece_raw"), ("calibrated", "ece_cal")):
            e = r[key]
            lines.append(
                f"| {r['variant']}, {label} | {temps if label == 'calibrated' else ''} | "
                f"{e.get('yes_no', 0):.4f} | {e.get('choice', 0):.4f} | {e.get('score', 0):.4f} | "
                f"**{e['all']:.4f}** |"
            )
    lines += [
        "",
        "Routes on the scoring split (`block`: insult.p_yes >= 0.9, then `review`: >= 0.5): "
        "the share of results each takes, and in brackets the share of those that are insults "
        "by the truth (a threshold of 0.9 that means what it says keeps that at 0.9 or more).",
        "",
        "| variant | block raw | block calibrated | review raw | review calibrated |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rows:
        cells = []
        for route in ("block", "review"):
            for key in ("routes_raw", "routes_cal"):
                share, right = r[key][route]
                cells.append(f"{share:.3f} ({right:.3f})")
        lines.append(f"| {r['variant']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Temperature keeps every answer (a power of the probabilities keeps their order), so "
        "accuracy is the same in every row; it moves only how sure the answers say they are. "
        "It undoes a temperature; against a bias towards yes it can only trade sharpness for "
        "honesty (docs/decisions.md).",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())

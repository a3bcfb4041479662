"""Deliberate mis-wirings of results, to show that the demo model's check can fail."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from dgstream.topology.demo_tasks.check import result_dict


def _swap_answer(answer: dict[str, Any]) -> dict[str, Any]:
    """The label -> answer mapping permuted: yes/no flipped, options and levels rotated."""
    a = dict(answer)
    t = a.get("type")
    if t == "yes_no":
        a["p_yes"] = round(1.0 - float(a["p_yes"]), 6)
        a["label"] = "no" if a["label"] == "yes" else "yes"
    elif t in ("choice", "score"):
        names = list(a["probabilities"])
        probs = [a["probabilities"][n] for n in names]
        rotated = names[1:] + names[:1]  # the probability of option k goes to option k+1
        a["probabilities"] = {n: p for n, p in zip(rotated, probs, strict=True)}
        key = "choice" if t == "choice" else "level"
        a[key] = rotated[names.index(a[key])]
    return a


def miswire_swap_labels(results: Sequence[Any]) -> list[dict[str, Any]]:
    out = []
    for r in results:
        d = result_dict(r)
        if isinstance(d.get("answers"), Mapping):
            d["answers"] = {q: _swap_answer(dict(a)) for q, a in d["answers"].items()}
        out.append(d)
    return out


def miswire_shift_results(results: Sequence[Any]) -> list[dict[str, Any]]:
    """Result i's answers attached to request i+1 (ids kept; the last wraps to the first)."""
    ds = [result_dict(r) for r in results]
    out = []
    for i, d in enumerate(ds):
        moved = dict(d)
        moved["answers"] = ds[i - 1].get("answers")
        out.append(moved)
    return out


MISWIRINGS = {"swap_labels": miswire_swap_labels, "shift_results": miswire_shift_results}

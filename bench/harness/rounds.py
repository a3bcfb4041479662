"""Ratios of two loops measured in alternating rounds on a shared machine, and reading
bench/worker_overhead.py's printed figures back (a baseline checkout's copy, or
bench/side_by_side.py's runs): pure functions, no broker."""

from __future__ import annotations

import re
import statistics

__all__ = ["PLAIN_ROW", "RUNS", "WORKER_ROW", "median_round", "numbers", "round_ratios"]

# The worker's row: its results/s, then the ratio in bold (`**0.87x**` before 2026-12-07's
# rounds; `0.86x (round by round: **0.99x**)` since).
WORKER_ROW = re.compile(
    r"^\| stream worker [^|]*\| ([\d,]+) \| [^|]*\*\*([\d.]+)x\*\*\)? \|$", re.M
)
PLAIN_ROW = re.compile(r"^\| plain loop, same work.*\| ([\d,]+) \| 1\.00x \|$", re.M)
# Every run, as printed: "(all runs: worker 1,411 / 1,403, same 1,641 / 1,592, echo ...".
RUNS = re.compile(r"all runs: worker ([\d,]+(?: / [\d,]+)*), same ([\d,]+(?: / [\d,]+)*)")


def numbers(text: str) -> list[float]:
    """`1,411 / 1,403` -> [1411.0, 1403.0]."""
    return [float(v.replace(",", "")) for v in text.split(" / ")]


def round_ratios(worker: list[float], plain: list[float]) -> list[float]:
    """Each round's worker run over the plain loop's run right after it."""
    return [w / p for w, p in zip(worker, plain, strict=True)]


def median_round(worker: list[float], plain: list[float]) -> float:
    """The median of the rounds' ratios: the figure the bar is read on. Each round pairs
    two runs seconds apart, so a drift of the shared machine's speed over the run moves
    both alike, where the best run of each may come from different minutes (2026-12-07,
    five rounds: best of each 0.86x, rounds 1.14 / 1.11 / 0.77 / 1.00 / 0.81)."""
    return statistics.median(round_ratios(worker, plain))

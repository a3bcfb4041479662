"""Compute-limited 24 GB card profiles: the SM share of the GPU machine's H100 that gives a
card's dense bf16 rate, and the card's own memory bandwidth for the rows that it bounds.

The emulation (sitecustomize.py here) caps memory at 23.6 GiB. A profile adds the compute:
under MPS, `CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=N` limits a process to N% of the SMs, and
`calibrate.py` measures on the machine which N gives the card's rate (a bf16 matmul), so
every figure reads "an H100 limited to N% of its SMs and 23.6 GiB". Memory bandwidth is not
limited (the H100's HBM3 stays 3.35 TB/s): where a row is bound by bandwidth, the card's
roofline (`roofline_ms`) goes beside it. Pure Python: tests/bench check it on the CPU.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CardProfile:
    name: str
    # Dense bf16 tensor rate with fp32 accumulate, TFLOP/s (the vendor's figure with
    # sparsity is twice this).
    bf16_tflops: float
    bandwidth_gb_s: float
    source: str


# The vendor's figures. Sources: NVIDIA L4 datasheet (BF16 Tensor Core 242 TFLOPS with
# sparsity, 300 GB/s); NVIDIA A10 datasheet (BF16 Tensor Core 125 TF, 250 TF with sparsity,
# 600 GB/s); NVIDIA Ada GPU Architecture whitepaper v2.01, appendix A (GeForce RTX 4090:
# peak FP16/BF16 Tensor TFLOPS with FP32 accumulate 165.2, 330.4 with sparsity; 1,008 GB/s);
# NVIDIA Ampere GA102 GPU Architecture whitepaper, appendix A (GeForce RTX 3090: 71 with FP32
# accumulate, 142 with FP16 accumulate; 936 GB/s). NVIDIA publishes no A10G figures; the
# a10 profile stands for it and says so.
PROFILES: dict[str, CardProfile] = {
    "l4": CardProfile("L4", 121.0, 300.0, "NVIDIA L4 datasheet: 242 TFLOPS BF16 with sparsity"),
    "a10": CardProfile(
        "A10 (A10G: no published rate; the A10's)",
        125.0,
        600.0,
        "NVIDIA A10 datasheet: BF16 Tensor Core 125 TF (250 TF with sparsity)",
    ),
    "rtx4090": CardProfile(
        "RTX 4090",
        165.2,
        1008.0,
        "NVIDIA Ada GPU Architecture whitepaper v2.01: 165.2 TFLOPS FP16/BF16, FP32 accumulate",
    ),
    "rtx3090": CardProfile(
        "RTX 3090",
        71.0,
        936.0,
        "NVIDIA GA102 whitepaper: 71 TFLOPS FP16/BF16 tensor, FP32 accumulate",
    ),
}
ALIASES = {"a10g": "a10", "4090": "rtx4090", "3090": "rtx3090"}
# The H100 SXM's HBM3 (NVIDIA H100 datasheet): what every emulated card reads its memory at.
H100_BANDWIDTH_GB_S = 3350.0


def profile(name: str) -> CardProfile:
    key = ALIASES.get(name.lower(), name.lower())
    if key not in PROFILES:
        raise KeyError(f"no card profile {name!r}; known: {', '.join(sorted(PROFILES))}")
    return PROFILES[key]


def interpolate(points: Mapping[int, float], percentage: float) -> float:
    """The measured rate (TFLOP/s) at an SM percentage, linear between measured points."""
    xs = sorted(points)
    if not xs:
        raise ValueError("no calibration points")
    if percentage <= xs[0]:
        return points[xs[0]] * percentage / xs[0]
    for lo, hi in itertools.pairwise(xs):
        if lo <= percentage <= hi:
            t = (percentage - lo) / (hi - lo)
            return points[lo] + t * (points[hi] - points[lo])
    return points[xs[-1]]


def share_for(points: Mapping[int, float], tflops: float, candidates: Sequence[int] = ()) -> int:
    """The whole SM percentage whose (interpolated) measured rate is nearest `tflops`."""
    span = candidates or range(1, 101)
    return min(span, key=lambda p: (abs(interpolate(points, p) - tflops), p))


def roofline_ms(flops: float, bytes_moved: float, card: CardProfile) -> dict[str, float]:
    """The real card's floor for a step: compute and bandwidth times, and the larger."""
    compute = flops / (card.bf16_tflops * 1e12) * 1e3
    memory = bytes_moved / (card.bandwidth_gb_s * 1e9) * 1e3
    return {"compute_ms": compute, "memory_ms": memory, "floor_ms": max(compute, memory)}


# The full-size NVFP4 shape's read, for the rooflines: 3.84e9 active parameters a token (the
# published shape built on an H200, docs/model.md), 2 FLOP each; a read of the benchmark's shapes
# brings 272 fresh tokens (a 256-token prompt, a 16-token canvas), one of a question set 48
# (its own 32 prompt tokens, the canvas). A step of 100 tokens or more touches every expert
# (8 of 128 a token), so it streams the weights vLLM reported loading (15.62 GiB, card24
# logs) less the tied bf16 embedding, of which it reads the label rows only
# (262,144 x 2,816 x 2 bytes).
FLOP_PER_TOKEN = 2 * 3.84e9
STEP_BYTES = 15.62 * 2**30 - 262_144 * 2_816 * 2
FRESH_TOKENS = {"unique": 272, "shared": 48}
# vLLM's token budget a step (VllmSettings.max_num_batched_tokens): a batch of 256 reads runs
# in steps this full.
STEP_TOKENS = 4096


def read_rooflines(card: CardProfile) -> dict[str, float]:
    """The card's floors for the card rows: a lone read's step (ms) and batch 256 (reads/s),
    unique prompts and one question set. A lone read is one step; at batch 256 every step
    holds the budget's tokens."""
    out: dict[str, float] = {}
    for kind, tokens in FRESH_TOKENS.items():
        lone = roofline_ms(tokens * FLOP_PER_TOKEN, STEP_BYTES, card)
        out[f"{kind}_b1_ms"] = lone["floor_ms"]
        out[f"{kind}_b1_bound"] = 1.0 if lone["memory_ms"] > lone["compute_ms"] else 0.0
        step = roofline_ms(STEP_TOKENS * FLOP_PER_TOKEN, STEP_BYTES, card)
        out[f"{kind}_b256_reads_s"] = (STEP_TOKENS / tokens) / (step["floor_ms"] / 1e3)
    return out


def describe(percentage: int, measured_tflops: float, card_gib: float = 23.6) -> str:
    """How every figure of such a card names it."""
    return (
        f"an H100 limited to {percentage}% of its SMs and {card_gib} GiB "
        f"({measured_tflops:.0f} dense bf16 TFLOP/s measured)"
    )


__all__ = [
    "ALIASES",
    "H100_BANDWIDTH_GB_S",
    "PROFILES",
    "CardProfile",
    "describe",
    "interpolate",
    "profile",
    "read_rooflines",
    "roofline_ms",
    "share_for",
]

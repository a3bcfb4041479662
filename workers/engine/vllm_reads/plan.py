"""One step of single-step reads, planned on the host from the batch's own metadata.

vLLM hands the sampler a step as numpy arrays (each request's slot, how many logit rows it
has: its canvas when it denoises, none while its prompt is still being read). Everything the
GPU side needs (which rows read against which label set, where each row's token goes, where
each request's logprobs start) is worked out here, in numpy, so the step moves a few index
arrays to the device once and never reads anything back. Pure numpy: unit-tested on the CPU.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

# A group of rows that read the same way: constrained to one allowed set (the request's
# logprob_token_ids), or over the full vocabulary reporting one tuple of ids.
GroupKey = tuple[bool, tuple[int, ...]]


@dataclass(frozen=True)
class Group:
    key: GroupKey
    # Row indices into the step's logit rows, ascending; None when the group is every row.
    rows: np.ndarray | None


@dataclass(frozen=True)
class StepPlan:
    decode: np.ndarray  # batch indices of the requests that denoise (read) this step
    prefill: np.ndarray  # batch indices of the requests still reading their prompt
    row_counts: np.ndarray  # [num_reqs] logit rows per request (0 for prefill)
    total_rows: int
    groups: tuple[Group, ...]
    # For every logit row: its request's batch index and its canvas position.
    row_request: np.ndarray
    row_position: np.ndarray
    # Where each request's rows start in the step's logprobs (vLLM's per-request offsets).
    offsets: list[int]

    @property
    def wants_logprobs(self) -> bool:
        return any(g.key[1] for g in self.groups)


def plan_step(
    slots: np.ndarray,
    row_counts: np.ndarray,
    constrained: Mapping[int, tuple[int, ...]],
    requested: Mapping[int, tuple[int, ...]],
) -> StepPlan:
    """`slots[i]` is request i's state slot, `row_counts[i]` its logit rows this step;
    `constrained[slot]` its allowed set when constrained, `requested[slot]` the ids its
    logprobs report (vLLM's `logprob_token_ids`, empty when none)."""
    row_counts = np.asarray(row_counts, dtype=np.int64)
    decode = np.flatnonzero(row_counts > 0)
    prefill = np.flatnonzero(row_counts == 0)
    counts = row_counts[decode]
    starts = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)
    total = int(counts.sum())
    keys: list[GroupKey] = []
    for i in decode:
        slot = int(slots[i])
        allowed = constrained.get(slot)
        keys.append((True, allowed) if allowed is not None else (False, requested.get(slot, ())))
    groups = _groups(keys, starts, counts)
    offsets = np.concatenate(([0], np.cumsum(row_counts)[:-1])).astype(np.int64)
    return StepPlan(
        decode=decode,
        prefill=prefill,
        row_counts=row_counts,
        total_rows=total,
        groups=groups,
        row_request=np.repeat(decode, counts),
        row_position=_positions(counts),
        offsets=offsets.tolist(),
    )


def _positions(counts: np.ndarray) -> np.ndarray:
    """0..n-1 for each count, concatenated."""
    if len(counts) == 0:
        return np.zeros(0, dtype=np.int64)
    total = int(counts.sum())
    starts = np.concatenate(([0], np.cumsum(counts)[:-1]))
    return np.arange(total, dtype=np.int64) - np.repeat(starts, counts)


def _groups(keys: Sequence[GroupKey], starts: np.ndarray, counts: np.ndarray) -> tuple[Group, ...]:
    distinct = list(dict.fromkeys(keys))
    if len(distinct) <= 1:
        return tuple(Group(k, None) for k in distinct)
    out = []
    for key in distinct:
        members = [j for j, k in enumerate(keys) if k == key]
        rows = np.concatenate([np.arange(starts[j], starts[j] + counts[j]) for j in members])
        out.append(Group(key, rows.astype(np.int64)))
    return tuple(out)


def spans(starts: np.ndarray, ends: np.ndarray) -> tuple[int, int] | np.ndarray:
    """The rows [starts[j], ends[j]) of several requests: one (start, end) pair when they
    are contiguous (a slice, no index to move), else every row index."""
    if len(starts) == 0:
        return (0, 0)
    if np.array_equal(starts[1:], ends[:-1]):
        return (int(starts[0]), int(ends[-1]))
    return np.concatenate([np.arange(s, e) for s, e in zip(starts, ends, strict=True)]).astype(
        np.int64
    )


def reports_raw_logits(params: Any) -> bool:
    """Whether a request's logprobs are read from its logits untouched: no top-k or
    top-p filter, no top-k logprobs. A read needs it on both sides: the read sampler,
    which serves only such reads, and the one-step scheduler, which fuses only them."""
    return (
        (getattr(params, "top_k", 0) or 0) <= 0
        and getattr(params, "top_p", 1.0) >= 1.0
        and (getattr(params, "logprobs", None) or 0) <= 0
    )


def fused_indices(is_prefilling: np.ndarray, cu_num_logits: np.ndarray) -> np.ndarray:
    """Batch indices of one-step reads (`scheduler.DgOneStepScheduler`): requests still
    reading their prompt that also have canvas rows this step."""
    n = len(is_prefilling)
    rows = np.diff(np.asarray(cu_num_logits[: n + 1], dtype=np.int64))
    return np.flatnonzero(np.asarray(is_prefilling, dtype=bool) & (rows > 0))


def fused_requests(batch: Any) -> np.ndarray:
    """`fused_indices` of a vLLM input batch (none when it carries no drafts)."""
    if getattr(batch, "num_draft_tokens", 0) == 0:
        return np.zeros(0, dtype=np.int64)
    n = int(batch.num_reqs)
    prefilling = batch.is_prefilling_np[:n]
    return fused_indices(prefilling, batch.cu_num_logits_np)


def fused_ranges(
    fused: np.ndarray, cu_num_logits: np.ndarray, prefill_len: np.ndarray, num_reqs: int
) -> np.ndarray:
    """[num_reqs, 1, 2] int32: for each one-step read its canvas's absolute positions,
    first and last (inclusive), zeros for every other request. Given to vLLM's Triton
    attention as its bidirectional ranges: a request stays causal (its prompt), and
    inside the range every position sees every other (the canvas), which is the mask of
    the two-step path's prompt step and canvas step together."""
    out = np.zeros((num_reqs, 1, 2), dtype=np.int32)
    if len(fused) == 0:
        return out
    rows = np.diff(np.asarray(cu_num_logits[: num_reqs + 1], dtype=np.int64))
    first = np.asarray(prefill_len, dtype=np.int64)[fused]
    out[fused, 0, 0] = first
    out[fused, 0, 1] = first + rows[fused] - 1
    return out


__all__ = [
    "Group",
    "GroupKey",
    "StepPlan",
    "fused_indices",
    "fused_ranges",
    "fused_requests",
    "plan_step",
    "reports_raw_logits",
    "spans",
]

"""The arithmetic of a batch of single-step reads: canvas rows in, what vLLM reports out.

Pure torch on whatever device the tensors are on (the unit tests run it on the CPU); the
sampler (`sampler.py`) feeds it the rows of one step. For every canvas row a read reports
what vLLM 0.33's own DiffusionGemma sampler stashes for a read-only request that converges
on its first step: column 0 is the row's argmax token, then the request's
`logprob_token_ids`, as log-probabilities at temperature 1; and the argmax's rank.

- Constrained rows (`label_rows`): logits over the allowed ids only (K columns), so the
  log-softmax is renormalised over them and the argmax is one of them.
- Full-vocabulary rows (`vocab_rows`): log-softmax over the whole vocabulary, gathered at
  the argmax and the requested ids.

No step here reads a value back to the host: the caller builds every index on the host
from the batch's own metadata and moves it once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(frozen=True)
class RowReads:
    """What a set of canvas rows reports, one row each."""

    token_ids: torch.Tensor  # [R] int64: the argmax token (the emitted canvas)
    columns: torch.Tensor  # [R, C] int64: column 0 the argmax, then the requested ids
    logprobs: torch.Tensor  # [R, C] float32: their log-probabilities
    ranks: torch.Tensor  # [R] int64: 1-based rank of the argmax (ties count)


def label_rows(logits: torch.Tensor, allowed: torch.Tensor) -> RowReads:
    """Rows whose logits cover only `allowed` ([R, K] float32, column j is `allowed[j]`)."""
    lp = logits.log_softmax(dim=-1)
    best = lp.argmax(dim=-1)
    chosen = lp.gather(1, best.unsqueeze(1))
    ranks = (lp >= chosen).sum(dim=1)
    token_ids = allowed[best]
    rows = logits.shape[0]
    columns = torch.cat((token_ids.unsqueeze(1), allowed.unsqueeze(0).expand(rows, -1)), dim=1)
    return RowReads(token_ids, columns, torch.cat((chosen, lp), dim=1), ranks)


def vocab_rows(logits: torch.Tensor, requested: torch.Tensor) -> RowReads:
    """Rows of full-vocabulary logits ([R, V] float32) and the ids every row reports
    ([K] int64, the same for every row; may be empty)."""
    norm = torch.logsumexp(logits, dim=-1, keepdim=True)
    top, best = logits.max(dim=-1, keepdim=True)
    ranks = (logits >= top).sum(dim=1)
    rows = logits.shape[0]
    ids = requested.unsqueeze(0).expand(rows, -1)
    picked = logits.gather(1, ids) - norm
    columns = torch.cat((best, ids), dim=1)
    return RowReads(best.squeeze(1), columns, torch.cat((top - norm, picked), dim=1), ranks)


def concat_rows(parts: list[RowReads]) -> RowReads:
    """Tiles of one group, in row order."""
    if len(parts) == 1:
        return parts[0]
    return RowReads(
        torch.cat([p.token_ids for p in parts]),
        torch.cat([p.columns for p in parts]),
        torch.cat([p.logprobs for p in parts]),
        torch.cat([p.ranks for p in parts]),
    )


def scatter_groups(total_rows: int, groups: list[tuple[torch.Tensor | None, RowReads]]) -> RowReads:
    """One step's groups back in row order. `groups`: (the group's row indices into the
    step, its reads); an index of None means the group is every row, in order.

    Groups of different widths are padded as vLLM pads a mixed batch: token id 0 at -inf,
    which its output processor never reports."""
    if len(groups) == 1 and groups[0][0] is None:
        return groups[0][1]
    first = groups[0][1]
    width = max(r.columns.shape[1] for _, r in groups)
    device = first.columns.device
    token_ids = torch.zeros(total_rows, dtype=torch.int64, device=device)
    columns = torch.zeros(total_rows, width, dtype=torch.int64, device=device)
    logprobs = torch.full(
        (total_rows, width), float("-inf"), dtype=first.logprobs.dtype, device=device
    )
    ranks = torch.zeros(total_rows, dtype=torch.int64, device=device)
    for index, r in groups:
        at = index if index is not None else slice(None)
        c = r.columns.shape[1]
        token_ids[at] = r.token_ids
        columns[at, :c] = r.columns
        logprobs[at, :c] = r.logprobs
        ranks[at] = r.ranks
    return RowReads(token_ids, columns, logprobs, ranks)


def to_device(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting: a copy from pageable memory makes the host
    wait for the stream, one from pinned memory does not (torch's pinned-memory cache keeps
    the staging buffer alive until the copy is done)."""
    return _staged(host, device).to(device, non_blocking=True)


def fill_device(dst: torch.Tensor, host: np.ndarray) -> None:
    """`host` written into `dst` in place (same shape), without waiting, as `to_device`:
    for a buffer whose address a CUDA graph holds."""
    dst.copy_(_staged(host, dst.device), non_blocking=True)


def _staged(host: np.ndarray, device: torch.device) -> torch.Tensor:
    """`host` as a tensor to copy to `device` from: pinned where that is a GPU."""
    t = torch.from_numpy(np.ascontiguousarray(host))
    return t.pin_memory() if device.type == "cuda" else t


__all__ = [
    "RowReads",
    "concat_rows",
    "fill_device",
    "label_rows",
    "scatter_groups",
    "to_device",
    "vocab_rows",
]

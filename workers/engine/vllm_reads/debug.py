"""Diagnostics of the read path on a GPU (the "-inf at a slot" failure of a compute-limited
card): off unless asked.

Everything here is inert unless its environment variable is set in the engine's process
(vLLM's engine core inherits the front end's environment):

- `DGSTREAM_READS_WATCH=1`: every read step, the GPU flags each canvas row whose hidden
  state holds a non-finite value, and each row whose reported logprobs are all non-finite
  or hold a NaN; the flags come back to the host without a sync (a copy and an event,
  polled on later steps) and a step with any flagged row is logged with its shape (which
  requests, how many rows, fused one-step reads, prompts finishing). It tells a value the
  GPU computed wrong from one the host read wrong. Each forward's output (every token of
  the step, not only the read rows) is checked too, and a step with a non-finite token is
  logged with the token ranges and the requests (by their place in the step) they fall in.
- `DGSTREAM_READS_DEBUG_DIR=DIR`: switches read per step from files in DIR, so one engine
  can run phases: `DIR/sync` present (or `DGSTREAM_READS_SYNC=1`, for a whole run) -> the
  engine core waits for the GPU (every stream) before it prepares each step, so the host
  never runs ahead of the device.
- `DGSTREAM_DEBUG_HUMMING_SMS=N`: vLLM's Humming kernels (NVFP4 on an H100/H200) are tuned
  for N streaming multiprocessors instead of the count the driver reports (under MPS the
  driver may report the share a process is limited to).

The summary line (`dgstream watch: ...`) is logged every `SUMMARY_EVERY` read steps.
"""

from __future__ import annotations

import os
from collections import deque
from typing import Any

import numpy as np

from dgstream.workers.engine.vllm_reads.loggers import reads_logger

logger = reads_logger("debug")

WATCH_ENV = "DGSTREAM_READS_WATCH"
DEBUG_DIR_ENV = "DGSTREAM_READS_DEBUG_DIR"
HUMMING_SMS_ENV = "DGSTREAM_DEBUG_HUMMING_SMS"
# A summary line every so many read steps (about a minute of steps at batch 32 on 15% of an
# H100's SMs): enough to see the watch ran without flooding the engine core's log.
SUMMARY_EVERY = 500
# Flagged steps logged in full; after that one line per 100 (a broken engine flags every step).
DETAIL_LIMIT = 40

_installed = False


def install() -> None:
    """Apply what the environment asks for in this process (idempotent)."""
    global _installed
    if _installed:
        return
    _installed = True
    sms = os.environ.get(HUMMING_SMS_ENV)
    if sms:
        _pin_humming_sms(int(sms))
    if os.environ.get(DEBUG_DIR_ENV) or os.environ.get("DGSTREAM_READS_SYNC") == "1":
        _sync_before_steps()


def _pin_humming_sms(sms: int) -> None:
    try:
        from humming import device
    except ImportError:  # vLLM without Humming: nothing to pin
        logger.warning("dgstream debug: humming not importable; %s ignored", HUMMING_SMS_ENV)
        return
    device.DeviceInfo.sm_count = property(lambda self: sms)
    logger.warning("dgstream debug: Humming kernels tuned for %d SMs", sms)


def flag(name: str) -> bool:
    """Whether DIR/name exists (DGSTREAM_READS_DEBUG_DIR), or DGSTREAM_READS_<NAME>=1 (a
    switch for a whole run)."""
    if os.environ.get(f"DGSTREAM_READS_{name.upper()}") == "1":
        return True
    directory = os.environ.get(DEBUG_DIR_ENV)
    return directory is not None and os.path.exists(os.path.join(directory, name))


def _sync_before_steps() -> None:
    import torch
    from vllm.v1.worker.gpu import model_runner

    runner = model_runner.GPUModelRunner
    original = runner.execute_model

    def execute_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        if flag("sync"):
            torch.cuda.synchronize()
        return original(self, *args, **kwargs)

    runner.execute_model = execute_model
    logger.warning(
        "dgstream debug: per-step sync switchable (%s/sync)", os.environ.get(DEBUG_DIR_ENV)
    )


def device_report() -> dict[str, Any]:
    """The SM count this process sees, from torch and from Humming (for the logs)."""
    import torch

    out: dict[str, Any] = {
        "torch_sms": torch.cuda.get_device_properties(0).multi_processor_count,
        "mps_percentage": os.environ.get("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"),
    }
    try:
        from humming.device import DeviceInfo

        out["humming_sms"] = int(DeviceInfo(0).sm_count)
    except Exception as exc:  # a probe: say what failed
        out["humming_sms"] = repr(exc)
    return out


def row_flags(rows: Any, logprobs: Any) -> Any:
    """[2, R] uint8 on the rows' device: row r's hidden state holds a non-finite value;
    row r's logprobs are all non-finite or hold a NaN (what the host would refuse)."""
    import torch

    hidden = (~torch.isfinite(rows)).any(dim=1)
    lp = (~torch.isfinite(logprobs)).all(dim=1) | torch.isnan(logprobs).any(dim=1)
    return torch.stack((hidden, lp)).to(torch.uint8)


def describe(flags: np.ndarray, meta: dict[str, Any]) -> dict[str, Any]:
    """A flagged step in words: how many rows, which requests, their kind. Pure numpy."""
    hidden, lp = flags[0].astype(bool), flags[1].astype(bool)
    row_request = np.asarray(meta["row_request"], dtype=np.int64)
    bad = hidden | lp
    reqs = sorted({int(r) for r in row_request[bad]})
    counts = np.bincount(row_request, minlength=meta["num_reqs"])
    bad_counts = np.bincount(row_request[bad], minlength=meta["num_reqs"])
    fused = set(int(i) for i in meta["fused"])
    return {
        "step": meta["step"],
        "rows": len(row_request),
        "bad_hidden_rows": int(hidden.sum()),
        "bad_logprob_rows": int(lp.sum()),
        "num_reqs": meta["num_reqs"],
        "num_tokens": meta["num_tokens"],
        "prefill_reqs": meta["prefill"],
        "fused_reqs": len(fused),
        "bad_reqs": len(reqs),
        "whole_reqs": sum(int(bad_counts[r] == counts[r]) for r in reqs),
        "bad_fused": sum(r in fused for r in reqs),
        "bad_req_ids": [meta["req_ids"][r] for r in reqs[:4]] if meta["req_ids"] else [],
    }


def token_ranges(bad: np.ndarray, starts: np.ndarray | None, limit: int = 8) -> dict[str, Any]:
    """Where a forward's non-finite tokens are: [start, end) ranges of token indices, and
    which requests of the step (by place, from its query start offsets) hold them. Pure
    numpy."""
    idx = np.flatnonzero(bad)
    ranges: list[tuple[int, int]] = []
    for i in idx.tolist():
        if ranges and ranges[-1][1] == i:
            ranges[-1] = (ranges[-1][0], i + 1)
        else:
            ranges.append((i, i + 1))
    out: dict[str, Any] = {
        "num_tokens": len(bad),
        "bad_tokens": len(idx),
        "ranges": ranges[:limit],
        "more_ranges": max(0, len(ranges) - limit),
    }
    if starts is not None and len(starts) > 1:
        real = int(starts[-1])
        where = np.searchsorted(starts, idx[idx < real], side="right") - 1
        reqs = sorted({int(r) for r in where})[:limit]
        out["requests"] = reqs
        out["request_spans"] = [(int(starts[r]), int(starts[r + 1])) for r in reqs]
        out["num_reqs"] = len(starts) - 1
        out["padding_tokens_bad"] = int((idx >= real).sum())
    return out


class StepWatch:
    """The per-step check behind DGSTREAM_READS_WATCH (see the module docstring)."""

    def __init__(self) -> None:
        self.pending: deque[tuple[Any, Any, dict[str, Any]]] = deque()
        self.token_pending: deque[tuple[Any, Any, np.ndarray | None, int]] = deque()
        self.steps = 0
        self.bad_steps = 0
        self.bad_rows = 0
        self.forwards = 0
        self.bad_forwards = 0
        # The step's query start offsets, set when its inputs are prepared.
        self.starts: np.ndarray | None = None

    def tokens(self, hidden: Any) -> None:
        """A forward's output, every token: flag the non-finite ones (no host sync)."""
        import torch

        if hidden.dim() != 2:
            return
        flags = (~torch.isfinite(hidden)).any(dim=1)
        host = flags.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.token_pending.append((event, host, self.starts, self.forwards))
        self.forwards += 1
        self.starts = None
        self.poll_tokens()

    def poll_tokens(self) -> None:
        while self.token_pending and self.token_pending[0][0].query():
            _, host, starts, n = self.token_pending.popleft()
            bad = host.numpy()
            if not bad.any():
                continue
            self.bad_forwards += 1
            if self.bad_forwards <= DETAIL_LIMIT or self.bad_forwards % 100 == 0:
                info = token_ranges(bad, starts)
                info["forward"] = n
                logger.warning("dgstream watch: non-finite tokens %s", info)

    def record(self, rows: Any, logprobs: Any, plan: Any, batch: Any, fused: Any) -> None:
        import torch

        flags = row_flags(rows, logprobs)
        host = flags.to("cpu", non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        n = int(batch.num_reqs)
        req_ids = list(getattr(batch, "req_ids", None) or ())
        meta = {
            "step": self.steps,
            "num_reqs": n,
            "num_tokens": int(getattr(batch, "num_tokens", 0)),
            "row_request": plan.row_request,
            "prefill": len(plan.prefill),
            "fused": np.asarray(fused),
            "req_ids": req_ids[:n],
        }
        self.steps += 1
        self.pending.append((event, host, meta))
        self.poll()
        if self.steps % SUMMARY_EVERY == 0:
            logger.warning(
                "dgstream watch: %d read steps, %d with a non-finite row (%d rows); "
                "%d forwards, %d with a non-finite token",
                self.steps,
                self.bad_steps,
                self.bad_rows,
                self.forwards,
                self.bad_forwards,
            )

    def poll(self) -> None:
        while self.pending and self.pending[0][0].query():
            _, host, meta = self.pending.popleft()
            flags = host.numpy()
            if not flags.any():
                continue
            self.bad_steps += 1
            info = describe(flags, meta)
            self.bad_rows += info["bad_hidden_rows"] + info["bad_logprob_rows"]
            if self.bad_steps <= DETAIL_LIMIT or self.bad_steps % 100 == 0:
                logger.warning("dgstream watch: non-finite rows %s", info)


_watch: StepWatch | None = None
_watch_off = False


def watch() -> StepWatch | None:
    """The process's watch when DGSTREAM_READS_WATCH is set, else None."""
    global _watch, _watch_off
    if _watch is None and not _watch_off and not os.environ.get(WATCH_ENV):
        _watch_off = True  # read once: this is called every forward
    if _watch is None and not _watch_off:
        _watch = StepWatch()
        try:
            logger.warning("dgstream watch on: %s", device_report())
        except Exception as exc:  # the report is a probe
            logger.warning("dgstream watch on (no device report: %r)", exc)
    return _watch


__all__ = [
    "DEBUG_DIR_ENV",
    "HUMMING_SMS_ENV",
    "WATCH_ENV",
    "StepWatch",
    "describe",
    "device_report",
    "flag",
    "install",
    "row_flags",
    "token_ranges",
    "watch",
]

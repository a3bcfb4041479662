"""The read sampler: one step of single-step reads, batched and without host syncs.

It wraps vLLM 0.33's `DiffusionSampler` (kept as `stock`, which serves every step that is
not all reads). For a step of reads it does what vLLM's sampler does for a read-only
request capped at one step, which emits its canvas on that step:

1. prompts that finish this step get their canvas (vLLM's own `_finish_prefills`);
2. the step's canvas rows are grouped by how they read (`plan.plan_step`: one allowed set,
   or the full vocabulary with one tuple of reported ids) and each group is unembedded and
   read in one go (`rows.label_rows`, or `rows.vocab_rows` one bounded tile at a time);
3. the argmax canvas and every row's logprobs go out as vLLM's `SamplerOutput`, with the
   per-request offsets computed on the host.

vLLM's sampler, for the same step, reads each converged request back to the host twice
(`.item()`), asks the driver for free memory, and draws its Gumbel seed on the GPU and
reads it back; here nothing is read back. The first call (vLLM's memory profile) also runs
one full tile of full-vocabulary rows, so the profile counts the largest thing a step of
reads allocates and `gpu_memory_utilization` sizes the KV cache around it.
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np
import torch
from vllm.v1.outputs import LogprobsTensors
from vllm.v1.worker.gpu.sample.penalties import use_penalty

from dgstream.workers.engine.vllm_reads import debug
from dgstream.workers.engine.vllm_reads.admission import Admissions
from dgstream.workers.engine.vllm_reads.loggers import reads_logger
from dgstream.workers.engine.vllm_reads.options import ReadPathOptions, vocab_tile_rows
from dgstream.workers.engine.vllm_reads.plan import (
    StepPlan,
    fused_requests,
    plan_step,
    reports_raw_logits,
)
from dgstream.workers.engine.vllm_reads.rows import (
    RowReads,
    concat_rows,
    label_rows,
    scatter_groups,
    to_device,
    vocab_rows,
)

logger = reads_logger("sampler")


class ReadModel(Protocol):
    """What the sampler reads rows through (`model.DgDiffusionGemma` is one)."""

    @property
    def lm_head(self) -> Any: ...

    def take_deferred(self) -> torch.Tensor | None:
        """The canvas rows the last forward pass left for the sampler (None: none)."""
        ...

    def label_logits(self, rows: torch.Tensor, allowed: tuple[int, ...]) -> torch.Tensor: ...

    def vocab_logits(self, rows: torch.Tensor) -> torch.Tensor: ...


class ReadState(Protocol):
    """What the sampler needs of the model state (`model.DgModelState` is one, and builds
    the sampler with itself): the model, the read path's options, the admissions it
    stages, the slots that hold reads, and whether reads take one step. The sampler
    imports nothing of model.py."""

    @property
    def model(self) -> ReadModel: ...

    @property
    def options(self) -> ReadPathOptions: ...

    @property
    def admissions(self) -> Admissions: ...

    @property
    def read_slots(self) -> set[int]: ...

    @property
    def one_step(self) -> bool: ...


class DgReadSampler:
    """vLLM's DiffusionGemma sampler with the read path in front of it."""

    def __init__(self, stock: Any, state: ReadState) -> None:
        self.stock = stock
        self.state = state
        self.model = state.model
        self.states = stock.diffusion_states
        vocab = int(stock.vocab_size)
        self.tile_rows = vocab_tile_rows(state.options.logits_tile_mib, vocab)
        # The ids each slot's logprobs report (vLLM's `logprob_token_ids`), host side.
        self.requested: dict[int, tuple[int, ...]] = {}
        self._profiled = False
        # Slots whose draft tokens vLLM would zero one by one on arrival: zeroed together.
        self._fresh_drafts: list[int] = []
        req_states = getattr(stock, "req_states", None)
        if hasattr(req_states, "draft_tokens") and hasattr(req_states, "add_request"):
            stage_draft_resets(req_states, self._fresh_drafts)

    # vLLM's runner reads these of its sampler.
    @property
    def sampling_states(self) -> Any:
        return self.stock.sampling_states

    @property
    def logprob_token_ids_state(self) -> Any:
        return self.stock.logprob_token_ids_state

    @property
    def penalties_state(self) -> Any:
        return self.stock.penalties_state

    def __getattr__(self, name: str) -> Any:
        # Anything else vLLM may ask of its sampler is the stock sampler's.
        return getattr(self.stock, name)

    # ------------------------------------------------------------------ admission

    def add_request(self, req_idx: int, sampling_params: Any) -> None:
        """What vLLM's sampler records for a request, with its GPU writes staged."""
        stock, states = self.stock, self.states
        if use_penalty(sampling_params):
            logger.warning_once("DiffusionGemma ignores repetition/frequency/presence penalties")
        stock._pending_logprobs.pop(req_idx, None)
        stock.sampling_states.add_request(req_idx, sampling_params)
        stock.logprob_token_ids_state.add_request(req_idx, sampling_params)
        extra = getattr(sampling_params, "extra_args", None) or {}
        cap = extra.get("diffusion_max_steps")
        steps = None if cap is None else max(1, min(int(cap), states.max_denoising_steps))
        if steps == 1:
            states.single_step_slots.add(req_idx)
        width = extra.get("diffusion_canvas_length")
        if width:
            states.canvas_width_np[req_idx] = max(1, min(int(width), stock.canvas_length))
        width = int(states.canvas_width_np[req_idx])
        seed = extra.get("diffusion_seed_canvas")
        if seed is not None and len(seed) != width:
            # vLLM's own refusal, word for word in substance (admission validated it).
            raise ValueError(
                f"diffusion_seed_canvas must hold exactly {width} ids, got {len(seed)}"
            )
        pins = extra.get("diffusion_pinned") if seed is not None else None
        read_only = bool(extra.get("diffusion_read_only"))
        ids = tuple(int(t) for t in (getattr(sampling_params, "logprob_token_ids", None) or ()))
        if extra.get("diffusion_constrained"):
            if not ids:
                raise ValueError("diffusion_constrained needs logprob_token_ids")
            states.constrained[req_idx] = ids
        self.requested[req_idx] = ids
        self.state.admissions.read(
            req_idx,
            max_steps=steps,
            seed=None if seed is None else [int(t) for t in seed],
            pins=None if not pins else [int(p) for p in pins],
            read_only=read_only,
        )
        if self._is_read(sampling_params, steps, read_only, pins):
            self.state.read_slots.add(req_idx)
        else:
            self.state.read_slots.discard(req_idx)

    @staticmethod
    def _is_read(params: Any, steps: int | None, read_only: bool, pins: Any) -> bool:
        return read_only and steps == 1 and not pins and reports_raw_logits(params)

    def apply_staged_writes(self) -> None:
        self.stock.sampling_states.apply_staged_writes()
        self.stock.logprob_token_ids_state.apply_staged_writes()
        drafts: Any = getattr(getattr(self.stock, "req_states", None), "draft_tokens", None)
        if self._fresh_drafts:
            slots = to_device(np.asarray(self._fresh_drafts, dtype=np.int64), drafts.device)
            drafts.index_fill_(0, slots, 0)
            self._fresh_drafts.clear()
        # After the zeroing: one-step reads find their seed canvas in the row.
        self.state.admissions.flush(drafts if self.state.one_step else None)

    # ------------------------------------------------------------------ steps

    def __call__(self, logits: torch.Tensor, input_batch: Any, draft_logits: Any = None) -> Any:
        rows = self.model.take_deferred()
        if not self._profiled:
            self._profiled = True
            self._profile_tile(logits)
        if rows is None:
            fused = fused_requests(input_batch)
            if len(fused) > 0:
                # A step vLLM's own sampler serves (it holds something that is not a
                # read): one-step reads get the state the two-step path gives them when
                # their prompt has been read, so that sampler denoises them as it would.
                self.stock._finish_prefills(input_batch, fused)
            return self.stock(logits, input_batch, draft_logits)
        if input_batch.num_draft_tokens == 0:
            return self.stock._handle_prefill(input_batch, rows.device)
        return self._read_step(rows, input_batch)

    def _profile_tile(self, logits: torch.Tensor) -> None:
        """One full tile of full-vocabulary rows, inside vLLM's memory profile."""
        weight: Any = self.model.lm_head.weight
        dummy = torch.zeros(
            self.tile_rows, int(weight.shape[1]), dtype=weight.dtype, device=logits.device
        )
        empty = torch.zeros(0, dtype=torch.int64, device=logits.device)
        vocab_rows(self.model.vocab_logits(dummy), empty)

    def _read_step(self, rows: torch.Tensor, batch: Any) -> Any:
        stock = self.stock
        n = batch.num_reqs
        slots = batch.idx_mapping_np[:n]
        counts = np.diff(batch.cu_num_logits_np[: n + 1])
        # 1. prompts done this step get their (seeded) canvas as vLLM does it.
        plan = plan_step(slots, counts, self.states.constrained, self.requested)
        if len(plan.prefill) > 0:
            stock._finish_prefills(batch, plan.prefill)
        # 2. every group of rows, read.
        reads = self._read_groups(rows, plan)
        watch = debug.watch()
        if watch is not None:
            watch.record(rows, reads.logprobs, plan, batch, fused_requests(batch))
        # 3. the argmax canvas, the counts and the logprobs, as vLLM's sampler gives them.
        device = rows.device
        sampled = stock._sampled[:n]
        sampled.zero_()
        where = to_device(np.stack((plan.row_request, plan.row_position)), device)
        sampled[where[0], where[1]] = reads.token_ids.to(sampled.dtype)
        num_sampled = stock._num_sampled[:n]
        num_sampled.copy_(to_device(plan.row_counts.astype(np.int32), device))
        logprobs = None
        if plan.wants_logprobs:
            logprobs = LogprobsTensors(
                logprob_token_ids=reads.columns,
                logprobs=reads.logprobs,
                selected_token_ranks=reads.ranks,
                cu_num_generated_tokens=plan.offsets,
            )
        return stock._build_output(
            batch, sampled, num_sampled, plan.row_counts, device, logprobs_tensors=logprobs
        )

    def _read_groups(self, rows: torch.Tensor, plan: StepPlan) -> RowReads:
        device = rows.device
        out: list[tuple[torch.Tensor | None, RowReads]] = []
        for group in plan.groups:
            index = None if group.rows is None else to_device(group.rows, device)
            sub = rows if index is None else rows[index]
            constrained, ids = group.key
            out.append((index, self._read(sub, constrained, ids)))
        return scatter_groups(plan.total_rows, out)

    def _read(self, rows: torch.Tensor, constrained: bool, ids: tuple[int, ...]) -> RowReads:
        if ids:
            requested = self.states.allowed_tensor(ids)  # vLLM's per-set device cache
        else:
            requested = torch.zeros(0, dtype=torch.int64, device=rows.device)
        if constrained:
            return label_rows(self.model.label_logits(rows, ids), requested)
        tiles = [
            vocab_rows(self.model.vocab_logits(rows[i : i + self.tile_rows]), requested)
            for i in range(0, rows.shape[0], self.tile_rows)
        ]
        return concat_rows(tiles)


def stage_draft_resets(req_states: Any, fresh: list[int]) -> None:
    """Make vLLM's runner state (`RequestState`) leave a new request's draft-token row to
    the step's one batched write: its `add_request` zeroes the row with one kernel launch
    per request when the model drafts (a canvas), 12% of the engine core's samples on one
    question set at four batches in flight (2026-12-03). The row is written by nothing
    before the step runs (the canvas is laid on it when the prompt has been read), so
    zeroing every new row at `apply_staged_writes` leaves the same state. The slot of each
    arrival goes to `fresh`."""
    original = req_states.add_request

    def add_request(*args: Any, **kwargs: Any) -> None:
        steps = req_states.num_speculative_steps
        req_states.num_speculative_steps = 0  # vLLM zeroes the row only when > 0
        try:
            original(*args, **kwargs)
        finally:
            req_states.num_speculative_steps = steps
        req_id = kwargs["req_id"] if "req_id" in kwargs else args[0]
        if steps > 0:
            fresh.append(req_states.req_id_to_index[req_id])

    req_states.add_request = add_request


__all__ = ["DgReadSampler", "stage_draft_resets"]

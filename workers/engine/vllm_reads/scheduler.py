"""One-step reads: a read's prompt and its canvas in one forward pass.

vLLM 0.33 runs a DiffusionGemma read in two engine steps: the prompt's prefill, then the
canvas (carried as the request's draft tokens) in the next step. At batch 1 that is two
forward passes back to back; at batch 256 every read goes through the scheduler, the
runner's bookkeeping and `update_from_output` twice. This scheduler adds the canvas to the
step that finishes the prompt, for the reads that can take it:

1. vLLM's own scheduling runs unchanged (`DiffusionAsyncScheduler.schedule`);
2. before the step's output is handed on, each new request of the step that is a seeded
   single-step read, whose whole remaining prompt is in this step, gets its canvas too:
   the KV slots for it (`allocate_slots`, only the difference), W more scheduled tokens
   and W draft placeholders, while the step's token budget holds them;
3. vLLM's async bookkeeping then counts the canvas as in flight, exactly as it does for
   the second step of the two-step flow, and the request ends when its output arrives.

With `one_step_idle_only` (`ReadPathOptions`; the engine's `one_step_reads: auto`) step 2
runs only when vLLM's scheduling left no request waiting: a backlogged engine reads in two
steps, which measured faster there, and an idle one in one, which measured faster there.

The runner lays the canvas (the seed, written at admission by `Admissions.flush`) on the
last W positions, and the model state gives those positions the bidirectional range the
canvas step has (`fused_ranges`). Anything that does not qualify (a prompt longer than the
step's budget, no free blocks, a request that is not a read) takes the two-step path.
"""

from __future__ import annotations

from typing import Any

from vllm.v1.core.sched.diffusion_scheduler import DiffusionAsyncScheduler

from dgstream.workers.engine.vllm_reads.loggers import reads_logger
from dgstream.workers.engine.vllm_reads.options import TWO_STEP_KEY, ReadPathOptions
from dgstream.workers.engine.vllm_reads.plan import reports_raw_logits

logger = reads_logger("scheduler")
# The fused-read counts that are logged (the first proves the path runs; then a heartbeat).
LOG_EVERY = 10_000

SCHEDULER_CLASS = "dgstream.workers.engine.vllm_reads.scheduler.DgOneStepScheduler"


def one_step_width(params: Any) -> int | None:
    """The canvas width of a request that may run in one step with its prompt, else None.

    It must be a read as the read path serves them (read-only, one denoising step, no
    pins, no top-k/top-p, no top-k logprobs) and carry its whole canvas as a seed: the
    runner takes the canvas from the draft-token row that admission wrote, and vLLM's own
    canvas (random noise under a shorter seed) is drawn only after the prompt step."""
    if params is None:
        return None
    extra = getattr(params, "extra_args", None) or {}
    if not extra.get("diffusion_read_only") or extra.get("diffusion_pinned"):
        return None
    if extra.get(TWO_STEP_KEY):
        return None  # the request opted out
    steps = extra.get("diffusion_max_steps")
    if steps is None or int(steps) != 1:
        return None
    seed = extra.get("diffusion_seed_canvas")
    width = extra.get("diffusion_canvas_length")
    if not seed or not width or len(seed) != int(width):
        return None
    if not reports_raw_logits(params):
        return None
    return int(width)


class DgOneStepScheduler(DiffusionAsyncScheduler):
    """vLLM's diffusion scheduler (async), with one-step reads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Reads fused since the start, and steps left to two steps for a backlog (read by
        # tests and logs).
        self.fused_reads = 0
        self.backlogged_steps = 0
        options = ReadPathOptions.from_additional_config(
            getattr(self.vllm_config, "additional_config", None)
        )
        self.idle_only = options.one_step_idle_only
        logger.info(
            "dgstream one-step reads on: a read's prompt and canvas in one step%s",
            " while no request waits" if self.idle_only else "",
        )

    def _update_after_schedule(self, scheduler_output: Any) -> None:
        self._fuse_canvases(scheduler_output)
        super()._update_after_schedule(scheduler_output)

    def waiting_requests(self) -> int:
        """Requests vLLM's scheduling left waiting (for a seat, the budget or KV blocks)."""
        return len(self.waiting) + len(getattr(self, "kv_holding_waiting", ()))

    def _fuse_canvases(self, out: Any) -> None:
        budget = self.max_num_scheduled_tokens - out.total_num_scheduled_tokens
        if budget <= 0 or not out.scheduled_new_reqs:
            return
        if self.idle_only and self.waiting_requests():
            self.backlogged_steps += 1
            return
        manager = self.kv_cache_manager
        for data in out.scheduled_new_reqs:
            request = self.requests[data.req_id]
            width = one_step_width(request.sampling_params)
            if width is None or width > budget:
                continue
            n = out.num_scheduled_tokens[data.req_id]
            # Only a prompt that finishes in this step (num_computed_tokens is not yet
            # advanced: it holds the prefix-cache hit). One prompt token over a cached
            # context is one vLLM's runner may run as a decode: left to two steps.
            if n < 2 or request.num_computed_tokens + n != request.num_tokens:
                continue
            if request.num_tokens + width > self.max_model_len:
                continue
            if manager.allocate_slots(request, n + width) is None:
                continue  # no free blocks: the two-step path, which waits for them
            out.num_scheduled_tokens[data.req_id] = n + width
            out.total_num_scheduled_tokens += width
            out.scheduled_spec_decode_tokens[data.req_id] = [-1] * width
            data.block_ids = manager.get_block_ids(data.req_id)
            budget -= width
            self.fused_reads += 1
            if self.fused_reads == 1 or self.fused_reads % LOG_EVERY == 0:
                logger.info("dgstream one-step reads: %d read(s) ran in one step", self.fused_reads)


__all__ = ["SCHEDULER_CLASS", "DgOneStepScheduler", "one_step_width"]

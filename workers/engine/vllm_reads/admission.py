"""Request admission for the read path: per-request state written once per step, not per
request.

vLLM 0.33's DiffusionGemma resets a slot's state with about a dozen one-element GPU writes
when a request arrives (`fill_` on each flag, a random canvas, the seed copied over), then
its sampler writes a few more: some twenty kernel launches a request, paid on the engine's
host thread between steps. Here every arrival of a step is staged on the host, and
`flush()` writes them all with one host-to-device copy and one indexed write per state
tensor. The random canvas written at arrival is skipped: vLLM draws a fresh one (and lays
the seed over it) when the prompt has been read, before any step reads it.

Works on vLLM's own `DiffusionGemmaRequestStates` (its tensors, on any device), so the unit
tests compare it with vLLM's per-request writes on the CPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dgstream.workers.engine.vllm_reads.rows import to_device


@dataclass
class _Arrival:
    prompt_len: int = 0
    max_steps: int | None = None
    seed: list[int] | None = None
    pins: list[int] | None = None
    read_only: bool = False


@dataclass
class Admissions:
    """Arrivals of the current step, by state slot."""

    states: Any  # vllm's DiffusionGemmaRequestStates
    pending: dict[int, _Arrival] = field(default_factory=dict)

    def reset(self, slot: int, prompt_len: int) -> None:
        """What vLLM's model state does on arrival (its host side now, its GPU side at
        `flush`)."""
        s = self.states
        self.pending[slot] = _Arrival(prompt_len=prompt_len)
        for held in (s.seeded_slots, s.read_only_slots, s.single_step_slots):
            held.discard(slot)
        s.constrained.pop(slot, None)
        s.canvas_width_np[slot] = s.canvas_length

    def read(
        self,
        slot: int,
        *,
        max_steps: int | None,
        seed: list[int] | None,
        pins: list[int] | None,
        read_only: bool,
    ) -> None:
        """What vLLM's sampler sets for the request's `extra_args` (host sets at once)."""
        s = self.states
        a = self.pending.setdefault(slot, _Arrival())
        a.max_steps, a.seed, a.pins, a.read_only = max_steps, seed, pins, read_only
        if seed is not None:
            s.seeded_slots.add(slot)
        if read_only:
            s.read_only_slots.add(slot)

    def release(self, slot: int) -> None:
        """A request left: only the host sets. Its GPU flags are reset before the slot
        serves again (`reset`), and no step reads a slot that holds no request."""
        s = self.states
        for held in (s.seeded_slots, s.read_only_slots, s.single_step_slots):
            held.discard(slot)
        s.constrained.pop(slot, None)
        self.pending.pop(slot, None)

    def flush(self, drafts: torch.Tensor | None = None) -> None:
        """Write the step's arrivals to the GPU state: one copy, one write per tensor.

        Every arrival gets what vLLM's reset and its sampler's `extra_args` would leave: a
        clean slot, then the read's own values. (vLLM's profiling pass registers sampling
        params without a reset, on slots no request has used yet: the same values.)

        `drafts` (vLLM's runner's draft-token rows, one-step reads only): each arrival's
        row gets its seed canvas (zeros without one), which a one-step read's canvas is
        read from in the step that admits it. The two-step path overwrites the row when
        the prompt has been read, so the write changes nothing there."""
        if not self.pending:
            return
        s = self.states
        width = s.canvas_length
        slots = sorted(self.pending)
        # One int64 matrix: slot, prompt length, max steps, seeded, read-only, then the
        # seed canvas and the pin mask (each canvas_length wide).
        host = np.zeros((len(slots), 5 + 2 * width), dtype=np.int64)
        for row, slot in enumerate(slots):
            a = self.pending[slot]
            steps = s.max_denoising_steps if a.max_steps is None else a.max_steps
            host[row, :5] = (slot, a.prompt_len, steps, a.seed is not None, a.read_only)
            if a.seed is not None:
                host[row, 5 : 5 + len(a.seed)] = a.seed
                if a.pins:
                    host[row, 5 + width + np.asarray(a.pins, dtype=np.int64)] = 1
        self.pending.clear()
        dev = to_device(host, torch.device(s.device))
        idx = dev[:, 0]
        # Constants go in as index_fill_'s scalar argument. `t[idx] = 0` would make a
        # 0-dim host tensor and copy it over from pageable memory, and CUDA runs such a
        # copy only after everything queued on the stream: under async scheduling the
        # engine core then waited here for the step in flight (four such copies per step
        # with arrivals in the torch profile of 2026-12-03; 51-57% of the engine core's
        # samples on unique prompts, on the first of them).
        s.is_encoder_phase.index_fill_(0, idx, True)
        s.step.index_fill_(0, idx, 0)
        s.accepted_canvas_history_len.index_fill_(0, idx, 0)
        s.self_conditioning_embeds.index_fill_(0, idx, 0)
        s.prompt_len[idx] = dev[:, 1].to(s.prompt_len.dtype)
        s.max_steps[idx] = dev[:, 2].to(s.max_steps.dtype)
        s.has_seed[idx] = dev[:, 3].bool()
        s.read_only[idx] = dev[:, 4].bool()
        s.seed_canvas[idx] = dev[:, 5 : 5 + width]
        s.pin_mask[idx] = dev[:, 5 + width :].bool()
        if drafts is not None:
            cols = min(width, int(drafts.shape[1]))
            drafts[idx, :cols] = dev[:, 5 : 5 + cols].to(drafts.dtype)


__all__ = ["Admissions"]

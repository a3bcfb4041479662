"""Oracles the engine tests compare against, kept out of the runtime modules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def label_logits_reference(model: Any, prompt_ids: Sequence[int], canvas_ids: Sequence[int]) -> Any:
    """A direct forward call of the model over one prompt and canvas: the logits at every
    canvas position, with none of the engine's caching, batching or slot gathering."""
    import torch

    device = next(model.parameters()).device
    with torch.inference_mode():
        out = model(
            input_ids=torch.tensor([list(prompt_ids)], device=device),
            decoder_input_ids=torch.tensor([list(canvas_ids)], device=device),
        )
    return out.logits[0]

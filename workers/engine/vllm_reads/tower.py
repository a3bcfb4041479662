"""A fix to transformers' Gemma 4 vision tower that both engines need: the transformers
engine (`workers.engine.vision`) and the read path's model inside vLLM, which imports only
its own package, so the fix lives here. Nothing here imports vLLM."""

from __future__ import annotations

from typing import Any


def fix_unpooled_mask(tower: Any) -> None:
    """Make the tower keep its valid patches when it does not pool (pooling_kernel_size 1,
    the demo's). transformers 5.20's `Gemma4VisionPooler` returns its mask of PADDING
    patches when it leaves the length as is, and `Gemma4VisionModel` keeps the rows that
    mask marks as if it marked the valid ones: an unpadded image comes out with no soft
    tokens at all. The pooler (no weights) is wrapped on the instance; pooling towers are
    left alone."""
    pooler = tower.pooler
    if getattr(pooler, "_dgstream_fixed", False):
        return
    inner = pooler.forward

    def forward(
        hidden_states: Any,
        pixel_position_ids: Any,
        padding_positions: Any,
        output_length: int | None = None,
    ) -> tuple[Any, Any]:
        hidden, mask = inner(hidden_states, pixel_position_ids, padding_positions, output_length)
        if output_length == hidden_states.shape[1]:  # not pooled: `mask` marks padding
            mask = ~padding_positions
        return hidden, mask

    pooler.forward = forward
    pooler._dgstream_fixed = True

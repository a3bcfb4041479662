"""The model side of training: tensors, the slot forward, losses, the pointer capture, the
experts' forward, the QK-norm scaling, and the model's wrapper."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np


def to_tensors(batch: dict[str, Any], device: Any) -> dict[str, Any]:
    import torch

    return {k: torch.from_numpy(np.ascontiguousarray(v)).to(device) for k, v in batch.items()}


def forward_slots(model: Any, t: dict[str, Any]) -> Any:
    """Full-vocabulary logits (softcapped, fp32) at every slot of the batch: (slots, V).
    A batch with images (`collate`'s `pixel_values`) has the tower's soft tokens put in
    place of its image tokens' embeddings (`images_laid`)."""
    undo = images_laid(model, t) if "pixel_values" in t else None
    try:
        out = model(
            input_ids=t["input_ids"],
            attention_mask=t["attention_mask"],
            position_ids=t["position_ids"],
            decoder_input_ids=t["decoder_input_ids"],
            decoder_attention_mask=t["decoder_attention_mask"],
            decoder_position_ids=t["decoder_position_ids"],
        )
    finally:
        if undo is not None:
            undo()
    return out.logits[t["rows"], t["cols"]]


def images_laid(model: Any, t: dict[str, Any]) -> Any:
    """Run the vision tower on the batch's images and make the encoder's next token
    embedding put each soft token at its image token's place (`image_rows`, `image_cols`),
    as `TransformersEngine._embed_with_images` does: where the engine laid them, not
    wherever the image token's id appears (in the demo vocabulary it is also " Day"). The
    model's own forward is unchanged; the hook removes itself after that one call (the
    decoder embeds its canvas next). Returns the hook's remover (for an error on the way)."""
    from dgstream.workers.engine.vllm_reads.tower import fix_unpooled_mask

    encoder = model.model.encoder
    fix_unpooled_mask(encoder.vision_tower)  # as `VisionInput.for_model` does for the engine
    features = encoder.get_image_features(
        t["pixel_values"], t["pixel_positions"], return_dict=True
    ).pooler_output
    if features.shape[0] != t["image_rows"].shape[0]:
        raise ValueError(f"{features.shape[0]} soft tokens for {t['image_rows'].shape[0]} tokens")
    embed = encoder.get_input_embeddings()
    handle: Any = None

    def put(module: Any, args: Any, out: Any) -> Any:
        handle.remove()
        if out.shape[:2] != t["input_ids"].shape:
            raise RuntimeError("the first embedding call was not the prompt's")
        return out.index_put((t["image_rows"], t["image_cols"]), features.to(out.dtype))

    handle = embed.register_forward_hook(put)
    return handle.remove


def label_hits(logits: Any, t: dict[str, Any]) -> Any:
    """Whether the argmax over each slot's labels is the target (the engine's decision)."""
    import torch

    ids = t["label_ids"]
    lab = logits.gather(1, ids.clamp(min=0)).masked_fill(ids < 0, -torch.inf)
    return ids.gather(1, lab.argmax(1, keepdim=True))[:, 0] == t["targets"]


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.05) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def capture_pointer(model: Any, layer: int) -> tuple[dict[str, Any], Any]:
    """Make decoder layer `layer` return its attention weights (eager attention; every other
    attention keeps SDPA) and keep them, differentiable, in the returned dict under "w"
    (batch x heads x canvas x keys) after each forward. The second value undoes it all."""
    import copy

    target = model.model.decoder.layers[layer].self_attn
    shared = target.config
    # Masks are built once per forward from the shared config; the eager form (additive
    # floats) is one SDPA also takes, the SDPA form (booleans) is not one eager takes.
    model.set_attn_implementation("eager")
    for name, module in model.named_modules():
        if name.endswith("self_attn") and "vision" not in name and module is not target:
            module.config = copy.copy(shared)
            module.config._attn_implementation = "sdpa"
    seen: dict[str, Any] = {}
    hook = target.register_forward_hook(lambda mod, args, out: seen.__setitem__("w", out[1]))

    def undo() -> None:
        hook.remove()
        for name, module in model.named_modules():
            if name.endswith("self_attn") and "vision" not in name:
                module.config = shared
        model.set_attn_implementation("sdpa")

    return seen, undo


def pointer_loss(weights: Any, t: dict[str, Any]) -> tuple[Any, Any]:
    """(-mean log of the best head's attention weight on the right option's name, the mean
    of that weight) over the slots that have a pointer target (`t["points"]`)."""
    sel = (t["points"] >= 0).float()
    w = weights[t["rows"], :, t["cols"], t["points"].clamp(min=0)]  # slots x heads
    best = w.float().max(1).values
    n = sel.sum().clamp(min=1)
    return -(best.clamp_min(1e-6).log() * sel).sum() / n, (best * sel).sum() / n


def dense_experts_forward(
    self: Any, hidden_states: Any, top_k_index: Any, top_k_weights: Any
) -> Any:
    """The MoE block with every expert run on every token, weighted by the router (zero
    where an expert was not chosen): the same sum as transformers' eager loop, without its
    per-expert gathers, `index_add_` and their backward (most of the step's small kernels:
    docs/data/train_step_profile.txt). 4 experts of width 48 cost little to run densely."""
    import torch

    weights = torch.zeros(
        hidden_states.shape[0],
        self.num_experts,
        dtype=top_k_weights.dtype,
        device=hidden_states.device,
    ).scatter(1, top_k_index, top_k_weights)
    gate, up = torch.einsum("th,eih->eti", hidden_states, self.gate_up_proj).chunk(2, dim=-1)
    out = torch.einsum("eti,ehi->eth", self.act_fn(gate) * up, self.down_proj)
    return (out * weights.t().unsqueeze(-1).to(out.dtype)).sum(0).to(hidden_states.dtype)


def use_experts(model: Any, name: str) -> None:
    """`eager` (transformers' loop) or `dense` (`dense_experts_forward`) for training."""
    if name == "dense":
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

        ALL_EXPERTS_FUNCTIONS.register("dense", dense_experts_forward)
    model.set_experts_implementation(name)


def scale_qk_norms(model: Any, factor: float) -> None:
    """Multiply the text layers' `q_norm`/`k_norm` weights by `factor`.

    Gemma 4 attention (hence DiffusionGemma's) RMS-normalizes queries and keys and then uses
    `scaling = 1.0`, so an attention logit is `head_dim * g_q * g_k * cos(q, k)`. With the
    norms' weights at their default 1.0 and head_dim 64 the logits of a fresh model have a
    standard deviation of about 8: every head attends almost one-hot to an arbitrary
    position (mean attention entropy 0.7 nats over ~300 keys, measured on the demo spec), the
    softmax is saturated and attention patterns barely learn. That is why runs 1-5 never
    learned the lookups (a question id to its question, an option to its letter).
    `head_dim ** -0.25` (0.354) on both weights gives logits of standard deviation ~1, the
    usual 1/sqrt(d) regime, and the weights stay trainable; trained checkpoints settle near
    it by themselves (0.345 on average in the committed one: `training.attention_entropy`)."""
    import torch

    with torch.no_grad():
        for weight in text_qk_norm_weights(model):
            weight.mul_(factor)


def text_qk_norm_weights(model: Any) -> list[Any]:
    """The text layers' `q_norm`/`k_norm` weights, each parameter once: the encoder's and
    the decoder's layers are distinct modules holding the SAME parameters (tied weights)."""
    seen: dict[int, Any] = {}
    for name, module in model.named_modules():
        if name.endswith(("q_norm", "k_norm")) and "vision" not in name:
            seen.setdefault(id(module.weight), module.weight)
    return list(seen.values())


class DemoModel:
    @staticmethod
    def load(path: Path) -> Any:
        import torch
        from transformers import DiffusionGemmaForBlockDiffusion

        return DiffusionGemmaForBlockDiffusion.from_pretrained(
            str(path), dtype=torch.float32
        ).eval()

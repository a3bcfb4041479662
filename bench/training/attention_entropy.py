"""How sharp the demo model's attention is: mean entropy (nats) and mean top weight of every
text attention layer over a few held-out requests, for a fresh model (the demo spec's seed)
with the q_norm/k_norm weights as they are and scaled, and for the committed checkpoint (and
`--also DIR`, another one).

This is the measurement behind `python -m bench.train_demo_model --qk-norm-scale`: with the norms at
1.0 a fresh model's heads attend almost one-hot (entropy ~0.7 nats over ~300 keys), so the
softmax is saturated and attention patterns barely learn; scaled by head_dim ** -0.25 they
start near uniform (~4.5-5.3 nats), the usual 1/sqrt(d) regime.

    python -m bench.training.attention_entropy            # CPU, a few seconds
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from bench.training.check import held_out_batch
from bench.training.model import (
    DemoModel,
    forward_slots,
    scale_qk_norms,
    text_qk_norm_weights,
)
from dgstream.workers.engine.template import ChatFormat, LayoutCache


def capture_attention(
    model: Any, batch: dict[str, Any], reduce: Callable[[str, Any], Any]
) -> tuple[Any, dict[str, Any]]:
    """One forward of `batch`: the slots' logits, and `reduce(name, weights)` for every text
    attention layer (weights: batch x heads x queries x keys; decoder queries are the canvas
    positions), keyed by the layer's module name in forward order."""
    import torch

    model.set_attn_implementation("eager")  # the only one that returns the weights
    model.eval()
    seen: dict[str, Any] = {}
    hooks = []
    for name, module in model.named_modules():
        if not name.endswith("self_attn") or "vision" in name:
            continue

        def hook(mod: Any, args: Any, kwargs: Any, out: Any, name: str = name) -> None:
            seen[name] = reduce(name, out[1].detach())

        hooks.append(module.register_forward_hook(hook, with_kwargs=True))
    try:
        with torch.no_grad():
            logits = forward_slots(model, batch)
    finally:
        for h in hooks:
            h.remove()
    return logits, seen


def layer_entropies(model: Any, batch: dict[str, Any]) -> dict[str, tuple[float, float]]:
    """Layer name -> (mean attention entropy in nats, mean top weight) over all queries."""

    def stats(name: str, weights: Any) -> tuple[float, float]:
        p = weights.clamp_min(1e-12)
        entropy = -(p * p.log()).sum(-1).mean()
        return float(entropy), float(weights.max(-1).values.mean())

    return capture_attention(model, batch, stats)[1]


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    from dgstream.workers.engine import models

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--scale", type=float, default=64**-0.25, help="q_norm/k_norm factor")
    p.add_argument("--also", default="", help="another checkpoint directory to measure")
    args = p.parse_args(argv)

    trained = models.TRAINED_DIRS["demo"]
    chat = ChatFormat(AutoTokenizer.from_pretrained(str(trained)))
    layouts = LayoutCache(chat.encode, models.SPECS["demo"].canvas_length)
    _, batch = held_out_batch(chat, layouts, split=3, count=args.requests)

    def fresh() -> Any:
        torch.manual_seed(models.SPECS["demo"].seed)
        return DiffusionGemmaForBlockDiffusion(models.tiny_config(models.SPECS["demo"]))

    builds = [("fresh", fresh), ("committed", lambda: DemoModel.load(trained))]
    if args.also:
        builds.append((args.also, lambda: DemoModel.load(Path(args.also))))
    print(
        "| model | q/k norm factor | mean q/k norm weight | mean entropy (nats), per layer "
        "| mean top weight |"
    )
    print("|---|---:|---:|---|---:|")
    for label, build in builds:
        # Only a fresh model is measured scaled: that is the initialisation choice.
        for factor in (1.0, args.scale) if label == "fresh" else (1.0,):
            model = build()
            if factor != 1.0:
                scale_qk_norms(model, factor)
            stats = layer_entropies(model, batch)
            ent = " ".join(f"{e:.2f}" for e, _ in stats.values())
            top = sum(t for _, t in stats.values()) / len(stats)
            norms = [float(w.mean()) for w in text_qk_norm_weights(model)]
            g = sum(norms) / len(norms)
            print(f"| {label} | {factor:.3f} | {g:.3f} | {ent} | {top:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where the demo model's answer slot looks: for one choice question, the top keys of every
decoder attention head at the slot (layer, head, token@position:weight), and the answer's
probabilities. A probe for the choice pointer (docs/benchmarks.md, demo-model history).

    python -m bench.training.slot_attention          # a French state
    python -m bench.training.slot_attention \
        --state "Hello thanks you are good" --truth english
    python -m bench.training.slot_attention \
        --model DIR --options italian,french,german,spanish
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from bench.training.attention_entropy import capture_attention
from bench.training.model import to_tensors
from bench.training.reads import collate, request_reads
from dgstream.topology import demo_tasks
from dgstream.workers.engine import models
from dgstream.workers.engine.template import ChatFormat, LayoutCache


def probe_example(state: str, options: Sequence[str], truth: str) -> demo_tasks.Example:
    """One request with one language choice question ("lang") over `options`."""
    question = {
        "type": "choice",
        "instructions": "Which language is the message in?",
        "criteria": dict.fromkeys(options),
    }
    return demo_tasks.Example(
        {"id": "probe", "state": state, "questions": {"lang": question}},
        {"lang": truth},
        {"lang": demo_tasks.TaskQuestion("language")},
    )


def slot_attention(model: Any, chat: ChatFormat, ex: demo_tasks.Example, top: int = 5) -> Any:
    """(answer probabilities by option, [(layer, head, [(token, position, weight)])])."""
    import torch

    layouts = LayoutCache(chat.encode, models.SPECS["demo"].canvas_length)
    ((read, _, _),) = request_reads(chat, layouts, ex, seed=0)
    tokens = chat.tokenizer.convert_ids_to_tokens([*read.prompt_ids, *read.canvas_ids])
    query = read.slots[0].position  # the decoder's queries are the canvas positions
    batch = to_tensors(collate([(read, [0], ["choice"])], chat.pad_id), "cpu")
    logits, rows = capture_attention(
        model,
        batch,
        lambda name, w: w[0, :, query] if "decoder" in name else None,  # (heads, keys)
    )
    weights = {
        int(name.split("layers.")[1].split(".")[0]): row
        for name, row in rows.items()
        if row is not None
    }
    probs = torch.softmax(logits[0, list(read.slots[0].label_ids)], -1).tolist()
    heads = []
    for layer in sorted(weights):
        for head, row in enumerate(weights[layer]):
            best = torch.topk(row, top)
            keys = [
                (tokens[i], i, round(float(v), 2))
                for v, i in zip(best.values.tolist(), best.indices.tolist(), strict=True)
            ]
            heads.append((layer, head, keys))
    options = list(ex.request["questions"][read.slots[0].question_id]["criteria"])
    return dict(zip(options, [round(p, 3) for p in probs], strict=True)), heads


def main(argv: Sequence[str] | None = None) -> int:
    import torch
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(models.TRAINED_DIRS["demo"]))
    p.add_argument("--state", default="Bonjour merci oui monsieur les et est avec pour tres bien")
    p.add_argument("--options", default="italian,french,german,spanish")
    p.add_argument("--truth", default="french")
    args = p.parse_args(argv)
    chat = ChatFormat(AutoTokenizer.from_pretrained(args.model))
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(args.model, dtype=torch.float32)
    ex = probe_example(args.state, args.options.split(","), args.truth)
    probs, heads = slot_attention(model, chat, ex)
    print("answer probabilities:", probs)
    for layer, head, keys in heads:
        print(f"decoder layer {layer} head {head}:", "  ".join(f"{t}@{i}:{w}" for t, i, w in keys))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

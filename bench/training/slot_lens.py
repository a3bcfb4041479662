"""When the demo model's answer slot knows the category: a logit lens at the slot. The
decoder's hidden state after each layer goes through the final norm and the tied embedding;
for every choice slot (and name slot, `--name-share`) of held-out requests the printed
figure is how often the true category's NAME leads among the names of its universe
(languages or topics), per question type and decoder layer.

The probe behind rounds 9-12 in docs/benchmarks.md: on r8a (the checkpoint at commit
6e7cedf) topic names led at topic choice slots after decoder layer 0 (0.89) while topic
choice stood at 0.50, so the category was there and the lookup was missing.

    python -m bench.training.slot_lens       # the committed checkpoint, CPU, ~10 s
    python -m bench.training.slot_lens --model DIR --count 400
"""

from __future__ import annotations

import argparse
import collections
from collections.abc import Sequence
from typing import Any

from bench.training.model import DemoModel, forward_slots, to_tensors
from bench.training.questions import name_token, with_name_question
from bench.training.reads import collate, request_reads
from dgstream.topology import demo_tasks
from dgstream.workers.engine import models
from dgstream.workers.engine.template import ChatFormat, LayoutCache

_UNIVERSE = {
    "language": demo_tasks.LANGUAGES,
    "name_language": demo_tasks.LANGUAGES,
    "topic": demo_tasks.TOPICS,
    "name_topic": demo_tasks.TOPICS,
}


def slot_lens(model: Any, chat: ChatFormat, examples: Sequence[demo_tasks.Example]) -> Any:
    """{question type: {decoder layer: share of slots whose true name leads}}."""
    import torch

    layouts = LayoutCache(chat.encode, models.SPECS["demo"].canvas_length)
    items, slots = [], []
    for ex in examples:
        for read, targets, kinds in request_reads(chat, layouts, ex, seed=0):
            items.append((read, targets, kinds))
            slots += [(ex.tasks[s.question_id].task, ex.truth[s.question_id]) for s in read.slots]
    batch = to_tensors(collate(items, chat.pad_id), "cpu")
    decoder = model.model.decoder
    after: dict[int, Any] = {}
    hooks = [
        layer.register_forward_hook(lambda mod, args, out, i=i: after.__setitem__(i, out))
        for i, layer in enumerate(decoder.layers)
    ]
    try:
        with torch.no_grad():
            forward_slots(model, batch)
    finally:
        for h in hooks:
            h.remove()
    hits: dict[str, dict[int, list[bool]]] = collections.defaultdict(
        lambda: collections.defaultdict(list)
    )
    with torch.no_grad():
        for layer, hidden in sorted(after.items()):
            logits = model.lm_head(decoder.norm(hidden[batch["rows"], batch["cols"]]))
            for k, (task, truth) in enumerate(slots):
                if task not in _UNIVERSE:
                    continue
                names = _UNIVERSE[task]
                ids = [name_token(chat, n) for n in names]
                hits[task][layer].append(names[int(logits[k, ids].argmax())] == truth)
    return {
        task: {layer: sum(v) / len(v) for layer, v in sorted(by_layer.items())}
        for task, by_layer in sorted(hits.items())
    }


def main(argv: Sequence[str] | None = None) -> int:
    from transformers import AutoTokenizer

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=str(models.TRAINED_DIRS["demo"]))
    p.add_argument("--count", type=int, default=200, help="held-out requests (split 0)")
    args = p.parse_args(argv)
    chat = ChatFormat(AutoTokenizer.from_pretrained(args.model))
    model = DemoModel.load(args.model)
    # Half of the requests also get a name question (the training-only kind), so the lens
    # at a slot whose answer IS the name can be compared with the choice slots.
    examples = [
        with_name_question(ex, i, 0.5)
        for i, ex in enumerate(demo_tasks.held_out_examples(0, args.count))
    ]
    table = slot_lens(model, chat, examples)
    layers = sorted({layer for row in table.values() for layer in row})
    print("question type  " + " ".join(f"L{layer:<4}" for layer in layers))
    for task, row in table.items():
        print(f"{task:<14} " + " ".join(f"{row.get(layer, 0.0):.2f} " for layer in layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

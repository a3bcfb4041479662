"""The demo model's training script: the attention temperature at init and the training mix.

`scale_qk_norms` is why runs after 2026-11-30's round 1 learn lookups at all (see
docs/benchmarks.md, "How the committed checkpoint was trained"); these tests pin what its
default rests on. The mix (`--keep-other`) must stay deterministic and keep every request
with a choice question; the training-only category and name questions (`--category-share`,
`--name-share`) must carry the task family's own truth.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from bench.training.attention_entropy import layer_entropies
from bench.training.check import held_out_batch
from bench.training.data import (
    CHOICE_TASKS,
    GroupJob,
    _init_worker,
    _kept,
    make_group,
)
from bench.training.loop import main
from bench.training.model import (
    DemoModel,
    capture_pointer,
    forward_slots,
    pointer_loss,
    scale_qk_norms,
)
from bench.training.questions import (
    KINDS,
    name_token,
    with_category_question,
    with_mention_question,
    with_name_question,
)
from bench.training.reads import PointerMarks, pointer_targets, request_reads
from dgstream.schemas.names import is_question_id
from dgstream.topology import demo_tasks
from dgstream.workers.engine import models
from dgstream.workers.engine.template import ChatFormat, LayoutCache

pytestmark = pytest.mark.model


def _fresh() -> Any:
    import torch
    from transformers import DiffusionGemmaForBlockDiffusion

    torch.manual_seed(models.SPECS["demo"].seed)
    return DiffusionGemmaForBlockDiffusion(models.tiny_config(models.SPECS["demo"]))


def _text_norms(model: Any) -> dict[str, Any]:
    return {
        name: module.weight.detach().clone()
        for name, module in model.named_modules()
        if name.endswith(("q_norm", "k_norm")) and "vision" not in name
    }


@pytest.fixture(scope="module")
def chat_layouts() -> tuple[ChatFormat, LayoutCache]:
    from transformers import AutoTokenizer

    chat = ChatFormat(AutoTokenizer.from_pretrained(str(models.TRAINED_DIRS["demo"])))
    return chat, LayoutCache(chat.encode, models.SPECS["demo"].canvas_length)


@pytest.fixture(scope="module")
def batch(chat_layouts: tuple[ChatFormat, LayoutCache]) -> dict[str, Any]:
    return held_out_batch(*chat_layouts, split=3, count=4)[1]


def test_scale_qk_norms_scales_each_text_norm_once() -> None:
    model = _fresh()
    vision_before = {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if n.endswith(("q_norm", "k_norm")) and "vision" in n
    }
    before = _text_norms(model)
    assert before and all(bool((w == 1.0).all()) for w in before.values())
    scale_qk_norms(model, 0.25)
    after = _text_norms(model)
    # Shared (tied) modules are scaled once: 0.25, never 0.0625.
    assert all(bool((w == 0.25).all()) for w in after.values()), after
    for n, m in model.named_modules():
        if n in vision_before:
            assert bool((m.weight == vision_before[n]).all()), n


def test_default_scale_takes_a_fresh_model_out_of_one_hot_attention(batch: Any) -> None:
    """The measurement behind the default (head_dim ** -0.25): unscaled, a fresh model's
    deeper layers attend almost one-hot; scaled, every layer starts near uniform."""
    unscaled = layer_entropies(_fresh(), batch)
    model = _fresh()
    scale_qk_norms(model, models.SPECS["demo"].head_dim ** -0.25)
    scaled = layer_entropies(model, batch)
    assert set(unscaled) == set(scaled) and len(scaled) == 2 * 6  # encoder + decoder layers
    assert np.median([e for e, _ in unscaled.values()]) < 1.0, unscaled
    assert min(e for e, _ in scaled.values()) > 3.5, scaled


@pytest.fixture(scope="module")
def worker_state() -> None:
    _init_worker(str(models.TRAINED_DIRS["demo"]), models.SPECS["demo"].canvas_length)


def _choice_share(batches: list[dict[str, Any]]) -> float:
    kinds = np.concatenate([b["kinds"] for b in batches])
    return float((kinds == KINDS.index("choice")).mean())


def test_training_mix_is_deterministic_and_favours_choice(worker_state: None) -> None:
    plain = make_group(GroupJob(0, 0, 32, 2))
    focused = make_group(GroupJob(0, 0, 32, 2, keep_other=0.3))
    again = make_group(GroupJob(0, 0, 32, 2, keep_other=0.3))
    assert len(focused) == len(plain) == 2
    for a, b in zip(focused, again, strict=True):
        assert a.keys() == b.keys()
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert _choice_share(focused) > _choice_share(plain) + 0.03


def test_training_mix_keeps_every_choice_request() -> None:
    seeds = demo_tasks.training_seeds(5, 400)
    for s in seeds:
        ex = demo_tasks.example(s)
        has_choice = any(t.task in CHOICE_TASKS for t in ex.tasks.values())
        if has_choice:
            assert _kept(ex, s, 0.0)
        assert _kept(ex, s, 1.0)
    kept = sum(_kept(demo_tasks.example(s), s, 0.3) for s in seeds)
    assert 0.55 * len(seeds) < kept < 0.85 * len(seeds)


def _added(
    add: Any, stream: int, count: int = 300
) -> Iterator[tuple[int, demo_tasks.Example, demo_tasks.Example, str]]:
    """(seed, request, request with the added question, its id) for the requests of training
    stream `stream` with room for one more question, after checking what holds for every
    `with_*_question`: share 0 adds nothing, the same seed adds the same question, a full
    request is left alone, the new id is a valid question id."""
    for s in demo_tasks.training_seeds(stream, count):
        ex = demo_tasks.example(s)
        out = add(ex, s, 1.0)
        assert add(ex, s, 0.0) is ex
        assert add(ex, s, 1.0) == out  # deterministic
        new = set(out.request["questions"]) - set(ex.request["questions"])
        if len(ex.request["questions"]) >= demo_tasks.MAX_QUESTIONS:
            assert out is ex
            continue
        (qid,) = new
        assert is_question_id(qid)
        yield s, ex, out, qid


def test_category_questions_have_the_family_truth(
    chat_layouts: tuple[ChatFormat, LayoutCache],
) -> None:
    """Each added question names one topic or language; its truth is the family's own
    (`topic_of` / `language_of`), about half yes; nothing else in the request changes."""
    chat, layouts = chat_layouts
    added, yes = 0, 0
    for s, ex, out, qid in _added(with_category_question, 6):
        for old_id, q in ex.request["questions"].items():
            assert out.request["questions"][old_id] == q
            assert out.truth[old_id] == ex.truth[old_id]
        task, wire = out.tasks[qid].task, out.request["questions"][qid]
        state = ex.request["state"]
        names = demo_tasks.TOPICS if task == "about_topic" else demo_tasks.LANGUAGES
        words = set(wire["instructions"].rstrip("?").split())
        (named,) = [c for c in names if c in words]
        if task == "about_topic":
            actual = demo_tasks.topic_of(state)
        else:
            actual = demo_tasks.language_of(state)
        assert out.truth[qid] == ("yes" if named == actual else "no"), (state, wire)
        # The engine's reads carry it as a yes/no slot with the right target.
        reads = request_reads(chat, layouts, out, seed=s)
        kinds = {sl.question_id: k for r, _, ks in reads for sl, k in zip(r.slots, ks, strict=True)}
        assert kinds[qid] == "category"  # a yes/no slot, logged apart
        labels = {sl.question_id: sl.labels for r, _, _ in reads for sl in r.slots}
        assert labels[qid] == ("yes", "no")
        added += 1
        yes += out.truth[qid] == "yes"
    assert added > 100
    assert 0.3 < yes / added < 0.7


def test_name_questions_target_the_name_token(
    chat_layouts: tuple[ChatFormat, LayoutCache],
) -> None:
    """Each added name question lists the whole universe as options; its truth is the
    family's own topic or language, and its slot's target is the token the NAME is after
    `id: ` (not a letter), with the universe's name tokens as the logged labels."""
    chat, layouts = chat_layouts
    added, tasks = 0, set()
    for s, ex, out, qid in _added(with_name_question, 7):
        task, wire = out.tasks[qid].task, out.request["questions"][qid]
        state = ex.request["state"]
        if task == "name_topic":
            universe, actual = demo_tasks.TOPICS, demo_tasks.topic_of(state)
        else:
            universe, actual = demo_tasks.LANGUAGES, demo_tasks.language_of(state)
        assert sorted(wire["criteria"]) == sorted(universe)
        assert out.truth[qid] == actual
        reads = request_reads(chat, layouts, out, seed=s)
        for read, targets, kinds in reads:
            for slot, target, kind in zip(read.slots, targets, kinds, strict=True):
                if slot.question_id != qid:
                    continue
                assert kind == "name"
                assert slot.labels == tuple(wire["criteria"])
                (text,) = {chat.tokenizer.decode([target]).strip()}
                assert text == actual
                assert target == slot.label_ids[slot.labels.index(actual)]
        added += 1
        tasks.add(task)
    assert added > 100
    assert tasks == {"name_topic", "name_language"}


def test_mention_questions_name_one_option_in_the_state(
    chat_layouts: tuple[ChatFormat, LayoutCache],
) -> None:
    """The state gains one category name (never first, so it is the option's own token);
    the question's options hold it; the other questions' truths are those of the new state."""
    chat, layouts = chat_layouts
    added = 0
    for s, ex, out, qid in _added(with_mention_question, 8):
        state, wire = out.request["state"], out.request["questions"][qid]
        named = out.truth[qid]
        assert named in wire["criteria"]
        old, new = ex.request["state"].split(" "), state.split(" ")
        assert new[0] == old[0] and sorted(new) == sorted([*old, named])
        for other in (o for o in wire["criteria"] if o != named):
            assert other not in new
        for old_id, q in ex.request["questions"].items():
            assert out.truth[old_id] == demo_tasks.truth_of(state, out.tasks[old_id], q)
        # The option's token is in the prompt's state: the letter is found by identity.
        ids = chat.encode(state)
        assert name_token(chat, named) in ids
        reads = request_reads(chat, layouts, out, seed=s)
        kinds = {sl.question_id: k for r, _, ks in reads for sl, k in zip(r.slots, ks, strict=True)}
        assert kinds[qid] == "mention"
        added += 1
    assert added > 100


def test_aux_only_keeps_just_the_training_only_questions() -> None:
    job = GroupJob(0, 0, 16, 1, mention_share=1.0, name_share=0.5, aux_only=True)
    _init_worker(str(models.TRAINED_DIRS["demo"]), models.SPECS["demo"].canvas_length)
    (batch,) = make_group(job)
    kinds = {KINDS[k] for k in batch["kinds"]}
    assert kinds <= {"name", "mention"} and "mention" in kinds


_PROBE_STATES = {
    "english": "Hello thanks you are really good friend today",
    "french": "Bonjour merci oui monsieur les et est avec pour tres bien",
    "german": "Hallo danke ja der das und ist nicht mit sehr gut",
    "spanish": "Hola gracias si los el es muy bueno con para amigo",
    "italian": "Ciao grazie amico il sono molto bene oggi sempre anche",
}


@pytest.mark.parametrize("language", sorted(_PROBE_STATES))
def test_slot_attention_probe_finds_the_pointer(language: str) -> None:
    """The slot attention probe (`training.slot_attention`) on the committed checkpoint:
    every decoder head is reported, and for a state in each language one head points at that
    option's name (what `--point-weight` teaches; before it, only "english" was found:
    docs/benchmarks.md), which is then the answer."""
    import torch
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    from bench.training.slot_attention import probe_example, slot_attention

    trained = str(models.TRAINED_DIRS["demo"])
    chat = ChatFormat(AutoTokenizer.from_pretrained(trained))
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(trained, dtype=torch.float32)
    others = [lang for lang in demo_tasks.LANGUAGES if lang != language]
    options = [others[0], language, *others[1:3]]  # the answer second: not the letter A
    ex = probe_example(_PROBE_STATES[language], options, language)
    assert demo_tasks.language_of(ex.request["state"]) == language
    probs, heads = slot_attention(model, chat, ex)
    spec = models.SPECS["demo"]
    assert len(heads) == spec.num_hidden_layers * spec.num_attention_heads
    assert abs(sum(probs.values()) - 1) < 1e-3
    assert max(probs, key=probs.get) == language
    on_name = [w for _, _, keys in heads for tok, _, w in keys[:1] if tok == f"\u0120{language}"]
    assert on_name and max(on_name) > 0.5


def test_pointer_targets_are_the_right_options_name(
    chat_layouts: tuple[ChatFormat, LayoutCache],
) -> None:
    """Every choice and mention slot gets the prompt position of its true option's name,
    inside its own question block (slot i, block i), right after its letter; other slots
    get -1."""
    chat, layouts = chat_layouts
    marks = PointerMarks.of(chat)
    header = list(marks.question)
    found = 0
    for s in demo_tasks.training_seeds(5, 400):
        ex = with_mention_question(demo_tasks.example(s), s, 0.5)
        ex = with_name_question(ex, s, 0.3)
        for read, targets, kinds in request_reads(chat, layouts, ex, seed=s):
            ids = list(read.prompt_ids)
            points = pointer_targets(marks, read, targets, kinds)
            for i, (slot, t, k, p) in enumerate(
                zip(read.slots, targets, kinds, points, strict=True)
            ):
                if k not in ("choice", "mention"):
                    assert p == -1
                    continue
                truth = ex.truth[slot.question_id]
                assert ids[p] == name_token(chat, truth)
                assert ids[p - 2 : p] == [t, marks.colon]
                blocks_before = sum(
                    ids[j : j + len(header)] == header for j in range(p - len(header) + 1)
                )
                assert blocks_before == i + 1
                found += 1
    assert found > 200


def test_capture_pointer_keeps_the_forward_and_undoes_itself(batch: dict[str, Any]) -> None:
    """With one decoder layer switched to eager attention the slots' logits are those of the
    plain model, the kept weights are that layer's (rows sum to 1 over the keys), and undo
    puts every attention module back on the shared SDPA config."""
    import torch

    model = DemoModel.load(models.TRAINED_DIRS["demo"])
    with torch.no_grad():
        plain = forward_slots(model, batch)
        seen, undo = capture_pointer(model, 3)
        captured = forward_slots(model, batch)
        weights = seen["w"]
        undo()
        after = forward_slots(model, batch)
    b, q = batch["decoder_input_ids"].shape
    keys = batch["input_ids"].shape[1] + q
    assert weights.shape == (b, models.SPECS["demo"].num_attention_heads, q, keys)
    real = batch["decoder_attention_mask"].bool()[:, None, None, :].expand_as(weights)
    assert torch.allclose(weights.sum(-1), torch.ones(()), atol=1e-4)
    assert float(weights.masked_select(~real).abs().max()) == 0.0
    assert float((captured - plain).abs().max()) < 1e-4
    assert torch.equal(after, plain)
    configs = {
        id(m.config)
        for n, m in model.named_modules()
        if n.endswith("self_attn") and "vision" not in n
    }
    assert configs == {id(model.model.decoder.layers[3].self_attn.config)}
    assert model.config.text_config._attn_implementation == "sdpa"


def test_pointer_loss_reads_each_slots_best_head_at_its_point() -> None:
    import torch

    w = torch.full((2, 3, 4, 6), 0.01)  # batch x heads x canvas x keys
    w[0, 1, 2, 5] = 0.5  # slot 0: row 0, canvas 2, point 5; head 1 is the best
    w[1, 0, 3, 1] = 0.25  # slot 2: row 1, canvas 3, point 1
    t = {
        "rows": torch.tensor([0, 0, 1]),
        "cols": torch.tensor([2, 1, 3]),
        "points": torch.tensor([5, -1, 1]),  # slot 1 has no pointer target
    }
    loss, mean_weight = pointer_loss(w, t)
    assert loss.item() == pytest.approx(-(np.log(0.5) + np.log(0.25)) / 2, rel=1e-6)
    assert mean_weight.item() == pytest.approx(0.375)


def test_smoke_training_with_the_pointer_loss(tmp_path: Any) -> None:
    """`--smoke` (20 CPU steps) from the committed weights with the pointer loss: the
    training forward still matches `TransformersEngine` on the saved file (the script
    raises otherwise), and the log records the pointer and how to replay it."""
    import json

    out = tmp_path / "smoke"
    args = ["--smoke", "--init", str(models.TRAINED_DIRS["demo"]), "--out", str(out)]
    main([*args, "--mention-share", "0.5", "--point-layer", "3", "--point-weight", "1.0"])
    log = json.loads((out / "train_log.json").read_text())
    assert log["parity_max_abs_diff"] < 1e-4
    assert [step for step, _ in log["pointer_weight"]] == [5, 10, 15, 20]
    assert all(0 < w <= 1 for _, w in log["pointer_weight"])
    assert "--point-layer 3 --point-weight 1.0" in log["replay"]


def test_slot_lens_sees_the_category_the_name_slots_answer(
    chat_layouts: tuple[ChatFormat, LayoutCache],
) -> None:
    """The slot lens (`training.slot_lens`) on the committed checkpoint: at the last decoder
    layer the name slots' lens is their answer, so the true name leads for (nearly) all of
    them; every decoder layer is reported for each question type."""
    from bench.training.slot_lens import slot_lens

    chat, _ = chat_layouts
    examples = [
        with_name_question(ex, i, 1.0) for i, ex in enumerate(demo_tasks.held_out_examples(0, 60))
    ]
    table = slot_lens(DemoModel.load(models.TRAINED_DIRS["demo"]), chat, examples)
    layers = models.SPECS["demo"].num_hidden_layers
    assert {"name_language", "language", "topic"} <= set(table)
    assert all(list(row) == list(range(layers)) for row in table.values())
    assert table["name_language"][layers - 1] >= 0.95

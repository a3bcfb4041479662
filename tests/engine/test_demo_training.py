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

from bench import train_demo_model as T
from bench.attention_entropy import layer_entropies
from workers import demo_tasks
from workers.engine import models
from workers.engine.template import ChatFormat, LayoutCache

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
    return chat, LayoutCache(chat.encode, chat.eot_id, models.SPECS["demo"].canvas_length)


@pytest.fixture(scope="module")
def batch(chat_layouts: tuple[ChatFormat, LayoutCache]) -> dict[str, Any]:
    return T.held_out_batch(*chat_layouts, split=3, count=4)[1]


def test_scale_qk_norms_scales_each_text_norm_once() -> None:
    model = _fresh()
    vision_before = {
        n: m.weight.detach().clone()
        for n, m in model.named_modules()
        if n.endswith(("q_norm", "k_norm")) and "vision" in n
    }
    before = _text_norms(model)
    assert before and all(bool((w == 1.0).all()) for w in before.values())
    T.scale_qk_norms(model, 0.25)
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
    T.scale_qk_norms(model, models.SPECS["demo"].head_dim ** -0.25)
    scaled = layer_entropies(model, batch)
    assert set(unscaled) == set(scaled) and len(scaled) == 2 * 6  # encoder + decoder layers
    assert np.median([e for e, _ in unscaled.values()]) < 1.0, unscaled
    assert min(e for e, _ in scaled.values()) > 3.5, scaled


@pytest.fixture(scope="module")
def worker_state() -> None:
    T._init_worker(str(models.TRAINED_DIRS["demo"]), models.SPECS["demo"].canvas_length)


def _choice_share(batches: list[dict[str, Any]]) -> float:
    kinds = np.concatenate([b["kinds"] for b in batches])
    return float((kinds == T.KINDS.index("choice")).mean())


def test_training_mix_is_deterministic_and_favours_choice(worker_state: None) -> None:
    plain = T.make_group(T.GroupJob(0, 0, 32, 2))
    focused = T.make_group(T.GroupJob(0, 0, 32, 2, keep_other=0.3))
    again = T.make_group(T.GroupJob(0, 0, 32, 2, keep_other=0.3))
    assert len(focused) == len(plain) == 2
    for a, b in zip(focused, again, strict=True):
        assert a.keys() == b.keys()
        assert all(np.array_equal(a[k], b[k]) for k in a)
    assert _choice_share(focused) > _choice_share(plain) + 0.03


def test_training_mix_keeps_every_choice_request() -> None:
    seeds = demo_tasks.training_seeds(5, 400)
    for s in seeds:
        ex = demo_tasks.example(s)
        has_choice = any(t.task in T.CHOICE_TASKS for t in ex.tasks.values())
        if has_choice:
            assert T._kept(ex, s, 0.0)
        assert T._kept(ex, s, 1.0)
    kept = sum(T._kept(demo_tasks.example(s), s, 0.3) for s in seeds)
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
        assert demo_tasks.QUESTION_ID_RE.match(qid)
        yield s, ex, out, qid


def test_category_questions_have_the_family_truth(
    chat_layouts: tuple[ChatFormat, LayoutCache],
) -> None:
    """Each added question names one topic or language; its truth is the family's own
    (`topic_of` / `language_of`), about half yes; nothing else in the request changes."""
    chat, layouts = chat_layouts
    added, yes = 0, 0
    for s, ex, out, qid in _added(T.with_category_question, 6):
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
        reads = T.request_reads(chat, layouts, out, seed=s)
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
    for s, ex, out, qid in _added(T.with_name_question, 7):
        task, wire = out.tasks[qid].task, out.request["questions"][qid]
        state = ex.request["state"]
        if task == "name_topic":
            universe, actual = demo_tasks.TOPICS, demo_tasks.topic_of(state)
        else:
            universe, actual = demo_tasks.LANGUAGES, demo_tasks.language_of(state)
        assert sorted(wire["criteria"]) == sorted(universe)
        assert out.truth[qid] == actual
        reads = T.request_reads(chat, layouts, out, seed=s)
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
    for s, ex, out, qid in _added(T.with_mention_question, 8):
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
        assert T.name_token(chat, named) in ids
        reads = T.request_reads(chat, layouts, out, seed=s)
        kinds = {sl.question_id: k for r, _, ks in reads for sl, k in zip(r.slots, ks, strict=True)}
        assert kinds[qid] == "mention"
        added += 1
    assert added > 100


def test_aux_only_keeps_just_the_training_only_questions() -> None:
    job = T.GroupJob(0, 0, 16, 1, mention_share=1.0, name_share=0.5, aux_only=True)
    T._init_worker(str(models.TRAINED_DIRS["demo"]), models.SPECS["demo"].canvas_length)
    (batch,) = T.make_group(job)
    kinds = {T.KINDS[k] for k in batch["kinds"]}
    assert kinds <= {"name", "mention"} and "mention" in kinds


def test_slot_attention_probe_finds_the_english_pointer() -> None:
    """`bench.slot_attention` on the committed checkpoint: every decoder head is reported,
    and for an English state one head points at the option name "english" (the finding in
    docs/benchmarks.md), which is then the answer."""
    import torch
    from transformers import AutoTokenizer, DiffusionGemmaForBlockDiffusion

    from bench.slot_attention import slot_attention

    trained = str(models.TRAINED_DIRS["demo"])
    chat = ChatFormat(AutoTokenizer.from_pretrained(trained))
    model = DiffusionGemmaForBlockDiffusion.from_pretrained(trained, dtype=torch.float32)
    question = {
        "type": "choice",
        "instructions": "Which language is the message in?",
        "criteria": dict.fromkeys(("italian", "english", "german", "spanish")),
    }
    ex = demo_tasks.Example(
        {
            "id": "probe",
            "state": "Hello thanks you are really good friend today",
            "questions": {"lang": question},
        },
        {"lang": "english"},
        {"lang": demo_tasks.TaskQuestion("language")},
    )
    probs, heads = slot_attention(model, chat, ex)
    spec = models.SPECS["demo"]
    assert len(heads) == spec.num_hidden_layers * spec.num_attention_heads
    assert abs(sum(probs.values()) - 1) < 1e-3
    assert max(probs, key=probs.get) == "english"
    on_name = [w for _, _, keys in heads for tok, _, w in keys[:1] if tok == "Ġenglish"]
    assert on_name and max(on_name) > 0.5

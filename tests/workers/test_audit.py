"""The audit block: checkpoints named by revision or content, the prompt template's version
pinned to what is rendered, hashes that move exactly when what they cover moves."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest

from dgstream.schemas import Audit, ClassificationRequest, digest, parse_request
from dgstream.workers.engine.factory import EngineSettings, model_dir
from dgstream.workers.engine.template import PROMPT_TEMPLATE_VERSION
from dgstream.workers.results.audit import (
    Auditor,
    checkpoint_of,
    content_hash,
    engine_fields,
    routes_hash,
)
from dgstream.workers.routes import Route

pytestmark = pytest.mark.unit

DEMO = model_dir("demo")

# What each prompt template version renders for the request below (prompt and canvas
# token ids of its one read, with the demo tokenizer): a change to the template that keeps
# the version fails here. Bump PROMPT_TEMPLATE_VERSION and add its line.
PINNED = {"dgstream-prompt-1": "sha256:07a9c54294b0148a93ce9affffd1c2f9"}

REQUEST = (
    b'{"id": "pin", "state": "you are a stupid idiot!!! see deals.com", "questions": {'
    b'"insult": {"type": "noul", "instructions": "Does the message contain an insult?"},'
    b'"language": {"type": "choice", "instructions": "Which language is the message in?",'
    b' "criteria": {"english": null, "french": "ou le francais"}},'
    b'"excitement": {"type": "score", "instructions": "How many exclamation marks?",'
    b' "criteria": ["none", "one", "many"], "depends_on": ["insult"]}}}'
)


def _request(raw: bytes = REQUEST) -> ClassificationRequest:
    got = parse_request(raw)
    assert isinstance(got, ClassificationRequest), got
    return got


def test_the_prompt_template_version_is_pinned_to_what_is_rendered() -> None:
    from transformers import AutoTokenizer

    from dgstream.workers.engine.classifier import Classifier
    from dgstream.workers.engine.fake import FakeEngine
    from dgstream.workers.engine.template import ChatFormat

    chat = ChatFormat(AutoTokenizer.from_pretrained(str(DEMO)))
    seen: list[Any] = []

    class Recording(FakeEngine):
        async def read(self, reads: Any) -> Any:
            seen.extend(reads)
            return await super().read(reads)

    classifier = Classifier(Recording(vocab_size=chat.vocab_size), chat)
    asyncio.run(classifier.classify([_request()]))
    rendered = digest([[list(r.prompt_ids), list(r.canvas_ids)] for r in seen])
    assert PINNED.get(PROMPT_TEMPLATE_VERSION) == rendered, (
        f"the prompt or canvas changed ({rendered}): bump PROMPT_TEMPLATE_VERSION in "
        "workers/engine/template.py and pin the new version here"
    )


def test_a_checkpoint_is_named_by_its_content_unless_it_has_a_revision(tmp_path: Path) -> None:
    demo, source = checkpoint_of(EngineSettings(model="demo"))
    assert (demo, source) == (content_hash(DEMO), "content_hash")
    copy = tmp_path / "copy"
    shutil.copytree(DEMO, copy)
    (copy / ".lock").write_text("ignored")  # hidden files are not the checkpoint
    assert checkpoint_of(EngineSettings(model=str(copy))) == (demo, "content_hash")
    config = copy / "config.json"
    config.write_text(config.read_text().replace("}", ' , "x": 1}', 1))
    assert content_hash(copy) != demo
    commit = "0123456789abcdef0123456789abcdef01234567"
    snap = tmp_path / "models--org--m" / "snapshots" / commit
    shutil.copytree(DEMO, snap)
    assert checkpoint_of(EngineSettings(model=str(snap))) == (commit, "revision")
    assert checkpoint_of(EngineSettings(model="demo", revision="v2.1")) == ("v2.1", "declared")
    vllm = EngineSettings(backend="vllm", vllm={"model": "no-such/model", "revision": "abc"})
    assert checkpoint_of(vllm) == ("abc", "revision")
    remote = EngineSettings(backend="vllm-remote", remote={"model": "org/served"})
    assert checkpoint_of(remote) == ("org/served", "name")


def test_engine_fields_hold_what_changes_answers_only() -> None:
    a = engine_fields(EngineSettings(), 64, (0.5, 4))
    assert engine_fields(EngineSettings(max_batch_reads=8, reuse_prefix=False), 64, (0.5, 4)) == a
    assert engine_fields(EngineSettings(seed=1), 64, (0.5, 4)) != a
    assert engine_fields(EngineSettings(dtype="bfloat16"), 64, (0.5, 4)) != a
    assert engine_fields(EngineSettings(), 128, (0.5, 4)) != a


def _auditor(routes: list[Route], **kw: Any) -> Auditor:
    base: dict[str, Any] = {
        "pipeline": "mod",
        "deployment": "prod",
        "worker": "prod.mod-0",
        "engine": EngineSettings(),
        "model": "demo",
        "checkpoint": ("sha256:aa", "content_hash"),
        "canvas_length": 64,
        "auto": (0.5, 4),
        "routes": routes,
        "question_sets": {"moderation": _request().questions},
        "calibration": None,
    }
    return Auditor(**{**base, **kw})


def test_an_audit_names_the_route_its_rule_and_the_questions() -> None:
    block = Route(name="block", when="insult.p_yes >= 0.9", topic="t.block")
    auditor = _auditor([block])
    inline = _request()
    by_set = _request(b'{"id": "s", "state": "x", "question_set": "moderation"}')
    a = auditor.audit(inline, "block")
    assert (a.route, a.route_rule, a.route_acted) == ("block", "insult.p_yes >= 0.9", True)
    assert a.prompt_template == PROMPT_TEMPLATE_VERSION and a.question_set is None
    b = auditor.audit(by_set, "default")
    assert b.question_set == "moderation" and b.route_rule is None
    # The same questions hash alike, inline or by name.
    assert a.questions_hash == b.questions_hash
    changed = REQUEST.replace(b"stupid", b"silly").replace(b"an insult?", b"a slur?")
    assert auditor.audit(_request(changed), "block").questions_hash != a.questions_hash
    # What it writes validates as the published model.
    assert Audit.model_validate(a.model_dump()) == a
    assert a.engine_hash == digest(a.engine)
    shadow = _auditor([block], shadow=True).audit(inline, "block")
    assert shadow.route == "block" and shadow.route_acted is False


def test_the_routes_hash_moves_with_any_route() -> None:
    r1 = Route(name="block", when="insult.p_yes >= 0.9", topic="t.block")
    r2 = Route(name="review", when="insult.p_yes >= 0.5", topic="t.review")
    base = routes_hash([r1, r2])
    assert routes_hash([r1, r2]) == base
    assert routes_hash([r2, r1]) != base  # order decides: the first that holds wins
    assert routes_hash([r1, r2.model_copy(update={"when": "insult.p_yes >= 0.6"})]) != base
    assert routes_hash([]) != base

"""The local Jev example (topology/examples/jev-routes.yaml with jev-requests.jsonl), without
Kafka: each body is read as the worker reads a record without a key, answered by the
pipeline's own engine (the embedded demo model), routed by the pipeline's routes and written
in its output format. Every body lands where its ground truth says (the demo task family's
truth functions, from the state alone)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from dgstream.schemas import (
    ClassificationRequest,
    ClassificationResult,
    JevResponse,
    encode_output,
    parse_request,
    read_output,
)
from dgstream.schemas import record_id as make_record_id
from dgstream.topology import demo_tasks
from dgstream.topology.spec import load_topology
from dgstream.workers.engine.factory import build_classifier
from dgstream.workers.routes import DEFAULT_ROUTE, Router

pytestmark = pytest.mark.model

EXAMPLES = Path(__file__).resolve().parents[2] / "topology" / "examples"


def _expected_route(state: Any) -> str:
    """The example's routes applied to the truth: an insult blocks; a link shouted is
    reviewed; the rest passes."""
    text = state if isinstance(state, str) else state["message"]
    insult = demo_tasks.truth_of(text, demo_tasks.TaskQuestion("insult"), {}) == "yes"
    if insult:
        return "block"
    if demo_tasks.has_link(text) and demo_tasks.is_shouting(text):
        return "review"
    return DEFAULT_ROUTE


def test_jev_bodies_are_answered_routed_and_written_as_jev() -> None:
    topo = load_topology(EXAMPLES / "jev-routes.yaml")
    (pipe,) = topo.pipelines
    assert pipe.output_format == "jev" and [r.name for r in pipe.routes] == ["block", "review"]
    lines = (EXAMPLES / "jev-requests.jsonl").read_text(encoding="utf-8").splitlines()
    bodies = [json.loads(line) for line in lines]
    assert all("id" not in b and b["model"] == "jev-latest" for b in bodies)
    requests = []
    for offset, line in enumerate(lines):
        fallback = make_record_id(None, pipe.input_topics[0], 0, offset)
        req = parse_request(line.encode(), fallback_id=fallback)
        assert isinstance(req, ClassificationRequest), req
        assert req.id == f"jev.requests-0-{offset}" and req.id_source == "record"
        requests.append(req)
    classifier = build_classifier(pipe.engine, topo.question_sets_for(pipe))
    results = asyncio.run(classifier.classify(requests))
    router = Router(pipe.routes, pipe.output_topic)
    seen = set()
    for body, res in zip(bodies, results, strict=True):
        assert isinstance(res, ClassificationResult), res
        match = router.route(res)
        assert match.name == _expected_route(body["state"]), (body["state"], res)
        seen.add(match.name)
        out = read_output(encode_output(res, pipe.output_format))
        assert isinstance(out, JevResponse) and set(out.answers) == set(body["questions"])
        assert out.usage.input_tokens > 0
    assert seen == {"block", "review", DEFAULT_ROUTE}

"""Jev's own Python client (`typesafe-sdk`) against dgstream's wire contract.

A loopback HTTP stub stands where Jev's API would: it keeps each body the client posts,
reads it with `parse_request` exactly as a worker reads a record's value (no id: the
record's id is the fallback), answers it with the classifier (a fake engine, the demo
model's tokenizer) and replies with `encode_output(result, "jev")`. The client's own
response models must then read that reply.
"""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import typesafe_sdk as sdk  # a dev extra: CI installs it, so its absence fails

from dgstream.schemas import (
    ClassificationRequest,
    ClassificationResult,
    encode_output,
    parse_request,
)
from dgstream.schemas import record_id as make_record_id

pytestmark = pytest.mark.unit


class _Stub:
    """What the stub saw and the classifier it answers with."""

    def __init__(self) -> None:
        from transformers import AutoTokenizer

        from dgstream.workers.engine.classifier import Classifier
        from dgstream.workers.engine.fake import FakeEngine
        from dgstream.workers.engine.models import TRAINED_DIRS
        from dgstream.workers.engine.template import ChatFormat

        chat = ChatFormat(AutoTokenizer.from_pretrained(str(TRAINED_DIRS["demo"])))
        self.classifier = Classifier(FakeEngine(canvas_length=256), chat)
        self.bodies: list[bytes] = []
        self.paths: list[str] = []
        self.results: list[ClassificationResult] = []
        self.lock = threading.Lock()

    def answer(self, body: bytes) -> tuple[int, bytes]:
        with self.lock:
            offset = len(self.bodies)
            self.bodies.append(body)
        parsed = parse_request(body, fallback_id=make_record_id(None, "jev.in", 0, offset))
        if not isinstance(parsed, ClassificationRequest):
            return 422, json.dumps({"detail": [{"msg": str(parsed)}]}).encode()
        (result,) = asyncio.run(self.classifier.classify([parsed]))
        assert isinstance(result, ClassificationResult), result
        with self.lock:
            self.results.append(result)
        return 200, encode_output(result, "jev")


@pytest.fixture(scope="module")
def stub() -> Iterator[tuple[_Stub, str]]:
    state = _Stub()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            assert "Content-Encoding" not in self.headers  # compression is off below
            body = self.rfile.read(int(self.headers["Content-Length"]))
            state.paths.append(self.path)
            status, reply = state.answer(body)
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(reply)))
            self.end_headers()
            self.wfile.write(reply)

        def log_message(self, *args: Any) -> None:
            return None

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


@pytest.fixture
def client(stub: tuple[_Stub, str]) -> Iterator[Any]:
    import httpx2

    _, url = stub
    # trust_env off: no proxy from the environment between the client and the loopback stub.
    http = httpx2.Client(trust_env=False, timeout=30.0)
    with sdk.TypeSafeClient(
        api_key="test-key",
        base_url=url,
        retry=sdk.RetryPolicy(max_retries=0),
        compression=False,
        http_client=http,
    ) as c:
        yield c


def _last(stub: tuple[_Stub, str]) -> tuple[dict[str, Any], ClassificationRequest]:
    state, _ = stub
    body = state.bodies[-1]
    parsed = parse_request(body, fallback_id=make_record_id(b"k-1", "jev.in", 0, 0))
    assert isinstance(parsed, ClassificationRequest), parsed
    return json.loads(body), parsed


def test_noul_bodies_parse_unchanged_and_the_reply_reads(client: Any, stub: Any) -> None:
    reply = client.system_one(
        state="I was charged twice. Please help.",
        questions={
            "billing": sdk.Noul(instructions="Is this about billing?"),
            "spam": sdk.Noul(criteria={"true": "Unsolicited advertising"}),
            "refund": sdk.Noul(
                instructions={"task": "Does the customer ask for money back?"},
                criteria={"true": None, "false": ["a question", "a complaint"]},
            ),
        },
    )
    sent, parsed = _last(stub)
    assert stub[0].paths[-1] == "/v1/systemone"
    assert "id" not in sent and sent["model"] == "jev-latest"
    assert "instructions" not in sent["questions"]["spam"]  # the client leaves it out
    assert parsed.id == "k-1" and parsed.id_source == "key" and parsed.model == "jev-latest"
    assert parsed.questions is not None
    assert parsed.questions["refund"].instructions == (
        '{"task": "Does the customer ask for money back?"}'
    )
    ours = stub[0].results[-1]
    assert isinstance(reply, sdk.SystemOneResponse)
    assert set(reply.nouls) == {"billing", "spam", "refund"}
    for qid, answer in reply.nouls.items():
        assert answer.type == "noul" and answer.noul == ours.answers[qid].p_yes
    assert reply.model == ours.diagnostics.model
    assert reply.usage.input_tokens == ours.diagnostics.input_tokens > 0
    assert reply.usage.output_tokens == ours.diagnostics.output_tokens > 0


def test_choice_bodies_parse_unchanged_and_the_reply_reads(client: Any, stub: Any) -> None:
    options = {"calm": None, "angry": "An upset or hostile message", "excited": {"tone": "eager"}}
    reply = client.system_one(
        state={"message": "Please help.", "subject": "Duplicate charge"},
        questions={"tone": sdk.Choice(instructions="What is the tone?", criteria=options)},
    )
    sent, parsed = _last(stub)
    assert sent["state"] == {"message": "Please help.", "subject": "Duplicate charge"}
    assert parsed.state == json.dumps(sent["state"], ensure_ascii=False)
    assert parsed.questions is not None
    assert parsed.questions["tone"].answers == ("calm", "angry", "excited")
    ours = stub[0].results[-1].answers["tone"]
    tone = reply.choices["tone"]
    assert tone.choice == ours.choice and tone.choice in options
    assert tone.confidence == ours.confidence
    assert tone.probabilities == ours.probabilities
    assert list(tone.probabilities) == list(options)


def test_score_bodies_parse_unchanged_and_the_reply_reads(client: Any, stub: Any) -> None:
    levels = ["Can wait", "Needs attention this week", {"when": "today"}]
    reply = client.system_one(
        state=["ticket 1", {"body": "the site is down"}],
        questions={
            "urgency": sdk.Score(instructions="How urgent is this message?", criteria=levels),
            "size": {"type": "score", "criteria": ["small", "large"]},
        },
        model="jev-preview",
    )
    sent, parsed = _last(stub)
    assert sent["model"] == "jev-preview" and parsed.model == "jev-preview"
    assert parsed.questions is not None and parsed.questions["size"].instructions is None
    ours = stub[0].results[-1]
    urgency = reply.scores["urgency"]
    # The client keys score maps by integer level: ours are "0".."n-1".
    assert urgency.legend == {0: "Can wait", 1: "Needs attention this week", 2: '{"when": "today"}'}
    assert set(urgency.probabilities) == {0, 1, 2}
    assert sum(urgency.probabilities.values()) == pytest.approx(1, abs=1e-5)
    assert urgency.score == pytest.approx(
        sum(i * p for i, p in urgency.probabilities.items()), abs=1e-5
    )
    assert urgency.score == pytest.approx(ours.answers["urgency"].expected_score - 1, abs=1e-6)
    assert urgency.confidence == max(urgency.probabilities.values())
    assert set(reply.scores) == {"urgency", "size"}


def test_a_skipped_answer_is_passed_over_by_the_client(client: Any, stub: Any) -> None:
    """`ask_if` is ours; a Jev client that sends it reads the asked answers; the skipped one
    is left out of Jev's shape (whose models refuse an answer type they do not know)."""
    reply = client.system_one(
        state="hello",
        questions={
            "a": {"type": "noul", "instructions": "Is it a greeting?"},
            "b": {"type": "noul", "instructions": "Rude?", "ask_if": {"a": ["yes"]}},
            "c": {"type": "noul", "instructions": "Polite?", "ask_if": {"a": ["no"]}},
        },
    )
    ours = stub[0].results[-1]
    skipped = {q for q, a in ours.answers.items() if a.type == "skipped"}
    assert len(skipped) == 1
    assert set(reply.answers) == {"a", "b", "c"} - skipped
    # A Kafka consumer applies Jev's response model to the record's value directly.
    direct = sdk.SystemOneResponse.model_validate_json(encode_output(ours, "jev"))
    assert set(direct.nouls) == {"a", "b", "c"} - skipped


def test_an_option_count_past_one_read_is_refused_with_its_code(client: Any, stub: Any) -> None:
    with pytest.raises(sdk.TypeSafeAPIError) as caught:
        client.system_one(
            state="x",
            questions={"many": sdk.Choice(criteria={f"o{i}": None for i in range(40)})},
        )
    assert "TOO_MANY_OPTIONS" in str(caught.value.body)

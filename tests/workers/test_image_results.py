"""Results of requests with images, through the output builder: the audit
names each image by its SHA-256 and where it came from, in request order (a fetched one by
its URL without credentials); `openai_moderation` says a category applies to text and image;
`diagnostics.input_tokens` counts the image tokens the engine laid; routes read the answers
as before; and a text-only request's result keeps its bytes. The engine is the transformers
engine on the demo model (its vision tower), where one is needed."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import json
import threading
from collections.abc import Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from image_files import data_url, noisy_jpeg, png
from kafka import TopicPartition

from dgstream.schemas import (
    AuditImage,
    ClassificationRequest,
    ClassificationResult,
    YesNoAnswer,
    parse_request,
)
from dgstream.schemas.formats.openai_moderation import OPENAI_CATEGORIES, TEXT_ONLY
from dgstream.schemas.result import Diagnostics
from dgstream.workers.engine.classifier import Classifier
from dgstream.workers.engine.factory import EngineSettings, build_classifier
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.images import ImageSettings, InputGate
from dgstream.workers.images.gate import audit_url
from dgstream.workers.kafka.settings import KafkaConnection
from dgstream.workers.results.decisions import Decisions, RecordContext
from dgstream.workers.routes import Route
from dgstream.workers.steps.batches import Batch, Entry, Output
from dgstream.workers.steps.classify import BatchClassifier
from dgstream.workers.steps.outputs import OutputBuilder
from dgstream.workers.steps.topics import TopicGuard
from dgstream.workers.stream.engine_stage import with_images

QUESTIONS = {
    "toxic": {"type": "yes_no", "instructions": "Is it toxic?"},
    "severity": {
        "type": "score",
        "instructions": "How severe is it?",
        "criteria": ["none", "mild", "moderate", "severe"],
    },
}
# `<boi>`, 64 image tokens, `<eoi>`: what the transformers engine lays per image.
IMAGE_TOKENS = 66


class _Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


def _describe(topic: str) -> tuple[dict[str, Any], int | None, str | None]:
    return {"error_code": 0, "authorized_operations": ["WRITE"]}, 1_048_588, "producer"


def pipeline(**overrides: Any) -> WorkerSettings:
    return WorkerSettings.model_validate(
        {
            "pipeline": "images",
            "input_topics": ["requests"],
            "output_topic": "results",
            "dead_letter_topic": "dead",
            "group_id": "g",
            "kafka": KafkaConnection(bootstrap_servers="k:9092"),
            **overrides,
        }
    )


def outputs_builder(s: WorkerSettings, canvas_length: int = 256) -> tuple[OutputBuilder, Decisions]:
    # A declared checkpoint: nothing is hashed, and the audit is the same on every run.
    d = Decisions(
        s,
        model="demo",
        canvas_length=canvas_length,
        auto=(0.3, 4),
        checkpoint=("sha256:" + "0" * 32, "content_hash"),
    )
    return OutputBuilder(s, b"demo", TopicGuard(s, _describe), _Log(), d), d


def request(body: dict[str, Any]) -> ClassificationRequest:
    full = {"questions": QUESTIONS, "samples": 1, **body}
    if "input" not in full:
        full.setdefault("state", "hello there")
    got = parse_request(json.dumps(full).encode())
    assert isinstance(got, ClassificationRequest), got
    return got


def batch_of(reqs: Sequence[ClassificationRequest]) -> Batch:
    batch = Batch(seq=0)
    for i, r in enumerate(reqs):
        batch.add(Entry(TopicPartition("requests", 0), i, None, b"{}", 0, [], r))
    return batch


def through(
    classifier: Classifier,
    s: WorkerSettings,
    bodies: Sequence[dict[str, Any]],
    images: ImageSettings | None = None,
) -> list[Output]:
    """The requests as the worker's engine stage and output builder take them: the gate,
    the engine, each record's context given its images, the builder."""
    reqs = [request(b) for b in bodies]
    batch = batch_of(reqs)
    builder, decisions = outputs_builder(s, classifier.engine.info.canvas_length)
    gate = InputGate(images or ImageSettings(), classifier.engine.info)
    step = BatchClassifier(classifier, 0, 0.0, _Log(), gate=gate)
    outcomes = asyncio.run(step.classify(reqs))
    ctxs = [with_images(c, step) for c in decisions.contexts(batch)]
    return asyncio.run(builder.build(batch, outcomes, ctxs))


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.fixture(scope="module")
def seeing() -> Classifier:
    return build_classifier(EngineSettings(backend="transformers", model="demo", device="cpu"))


# --------------------------------------------------------------------------- URLs


@pytest.mark.unit
@pytest.mark.parametrize(
    ("url", "kept"),
    [
        ("https://cdn.example.com/a/b.png", "https://cdn.example.com/a/b.png"),
        # A pre-signed URL's credential is its query: never in a result.
        (
            "https://bucket.s3.amazonaws.com/u/1.jpg?X-Amz-Credential=AK%2F1&X-Amz-Signature=ab",
            "https://bucket.s3.amazonaws.com/u/1.jpg",
        ),
        ("https://media.example.com/x.png?sig=s3cr3t#frag", "https://media.example.com/x.png"),
        ("https://user:pw@media.example.com/x.png", "https://media.example.com/x.png"),
        ("HTTPS://Media.Example.COM:8443/X.png", "https://media.example.com:8443/X.png"),
        ("http://127.0.0.1:8080/img/a.png?t=1", "http://127.0.0.1:8080/img/a.png"),
        ("http://[::1]:8080/img/a.png", "http://[::1]:8080/img/a.png"),
        ("https://media.example.com/a%20b.png", "https://media.example.com/a%20b.png"),
    ],
)
def test_an_audited_url_keeps_what_names_the_object_and_drops_credentials(
    url: str, kept: str
) -> None:
    assert audit_url(url) == kept


_SECRET = "s3cr3tTOKEN"


@st.composite
def _urls(draw: st.DrawFn) -> str:
    host = draw(st.sampled_from(["cdn.example.com", "Media.Example.org", "10.1.2.3", "[::1]"]))
    port = draw(st.one_of(st.just(""), st.integers(1, 65535).map(lambda p: f":{p}")))
    user = draw(st.sampled_from(["", f"u:{_SECRET}@", f"{_SECRET}@"]))
    segment = st.text("abcXYZ019-_.~%", min_size=1, max_size=8).filter(
        lambda t: t not in (".", "..")
    )
    path = "/" + "/".join(draw(st.lists(segment, max_size=4)))
    query = draw(st.sampled_from(["", f"?token={_SECRET}", f"?a=1&sig={_SECRET}", "?"]))
    frag = draw(st.sampled_from(["", f"#{_SECRET}"]))
    return f"{draw(st.sampled_from(['http', 'HTTPS']))}://{user}{host}{port}{path}{query}{frag}"


@pytest.mark.unit
@given(url=_urls())
def test_no_audited_url_holds_a_credential_and_each_is_its_own_audit(url: str) -> None:
    kept = audit_url(url)
    parts = urlsplit(kept)
    assert _SECRET not in kept and "@" not in parts.netloc
    assert (parts.query, parts.fragment) == ("", "")
    assert parts.path == urlsplit(url).path and parts.hostname == urlsplit(url).hostname
    assert audit_url(kept) == kept


# --------------------------------------------------------------------------- the builder


def _result(p_yes: float, rid: str = "req-1") -> ClassificationResult:
    label = "yes" if p_yes >= 0.5 else "no"
    return ClassificationResult(
        id=rid,
        status="ok",
        answers={"toxic": YesNoAnswer(p_yes=p_yes, label=label, confidence=max(p_yes, 1 - p_yes))},
        diagnostics=Diagnostics(
            reads=1,
            entropy={"toxic": 0.5},
            label_mass={"toxic": 0.9},
            model="demo",
            engine="transformers",
            worker="w",
            timings={"engine_ms": 1.0},
            input_tokens=100,
            output_tokens=32,
        ),
    )


def _built(
    s: WorkerSettings, result: ClassificationResult, images: Sequence[AuditImage] | None
) -> Output:
    """`result`'s record; `images`: the record's context gets them (None: the context as
    the engine stage makes it for a text-only request)."""
    builder, decisions = outputs_builder(s)
    batch = batch_of([request({"id": result.id})])
    ctxs: list[RecordContext] = decisions.contexts(batch)
    if images is not None:
        ctxs = [dataclasses.replace(ctxs[0], images=tuple(images))]
    (out,) = asyncio.run(builder.build(batch, [result], ctxs))
    return out


# The bytes of `_result(0.7)`'s record, text only, as commit 574ede7 (before images reached
# the results) wrote them, dgstream_version pinned: sha256 of the value.
_TEXT_ONLY_BYTES = {
    "dgstream": "d6266e8953ed6bad48443baaf0eb7faaa2b0fc6982acb9155485b70b0f933c47",
    "openai_moderation": "349e265a7342cd2d833538ec718d3bc6cfca09e7968f4a73df2d93d3f5cfa330",
}


@pytest.mark.unit
@pytest.mark.parametrize("fmt", sorted(_TEXT_ONLY_BYTES))
def test_a_text_only_result_keeps_its_bytes(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("dgstream.workers.results.audit._version", lambda: "pinned")
    s = pipeline(output_format=fmt)
    value = _built(s, _result(0.7), None).value
    assert sha(value) == _TEXT_ONLY_BYTES[fmt], value
    assert b'"images":' not in value and b'"image"' not in value
    # An empty list of images is a text-only request: the same bytes.
    assert _built(s, _result(0.7), ()).value == value


_IMAGE = st.builds(
    AuditImage,
    field=st.sampled_from(["images.0", "images.7", "input.1.image_url.url", "assets.<image:1>"]),
    sha256=st.binary(min_size=1, max_size=8).map(sha),
    source=st.just("inline"),
    url=st.none(),
) | st.builds(
    lambda u, h: AuditImage(field="images.0", sha256=h, source="url", url=audit_url(u)),
    _urls(),
    st.binary(min_size=1, max_size=8).map(sha),
)


@pytest.mark.unit
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    images=st.lists(_IMAGE, max_size=8),
    p_yes=st.floats(0.0, 1.0),
    categories=st.sampled_from([{}, {"harassment": "toxic", "violence": "toxic"}]),
)
def test_the_builder_writes_the_images_a_result_was_read_with(
    images: list[AuditImage], p_yes: float, categories: dict[str, str]
) -> None:
    result = _result(p_yes)
    plain = pipeline()
    value = json.loads(_built(plain, result, images).value)
    if images:
        assert [AuditImage.model_validate(i) for i in value["audit"]["images"]] == images
    else:
        assert "images" not in value["audit"]
        assert _built(plain, result, images).value == _built(plain, result, None).value
    assert _SECRET.encode() not in _built(plain, result, images).value

    mod = pipeline(output_format="openai_moderation", moderation={"categories": categories})
    (m,) = json.loads(_built(mod, result, images).value)["results"]
    applied = m["category_applied_input_types"]
    asked = set(categories or {"toxic"})
    for name in [*OPENAI_CATEGORIES, *asked]:
        if name not in asked:
            assert applied[name] == []
        elif images and name not in TEXT_ONLY:
            assert applied[name] == ["text", "image"]
        else:
            assert applied[name] == ["text"]
    from openai.types import ModerationCreateResponse

    ModerationCreateResponse.model_validate_json(_built(mod, result, images).value)


# --------------------------------------------------------------------------- the engine


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


RED, BLUE, JPEG = png(), png(colour="blue"), noisy_jpeg()
CASES: dict[str, tuple[dict[str, Any], list[tuple[str, bytes]]]] = {
    "one inline": ({"images": [data_url(RED)]}, [("images.0", RED)]),
    "three, in order": (
        {"images": [data_url(JPEG, "image/jpeg"), data_url(BLUE), data_url(RED)]},
        [("images.0", JPEG), ("images.1", BLUE), ("images.2", RED)],
    ),
    "the same image twice": (
        {"images": [data_url(BLUE), data_url(BLUE)]},
        [("images.0", BLUE), ("images.1", BLUE)],
    ),
    "OpenAI input parts": (
        {
            "input": [
                {"type": "text", "text": "hello there"},
                {"type": "image_url", "image_url": {"url": data_url(RED)}},
            ]
        },
        [("input.1.image_url.url", RED)],
    ),
    "a Jev asset": (
        {"assets": {"<image:ab12>": {"type": "image", "format": "png", "data_base64": _b64(BLUE)}}},
        [("assets.<image:ab12>", BLUE)],
    ),
}


@pytest.mark.model
@pytest.mark.parametrize("case", sorted(CASES))
def test_a_result_read_from_images_names_them_counts_their_tokens_and_applies_to_both(
    seeing: Classifier, case: str
) -> None:
    body, expected = CASES[case]
    assert seeing.engine.info.image_tokens == IMAGE_TOKENS  # what the engine reports
    text, image = through(seeing, pipeline(), [{"id": "text"}, {"id": "image", **body}])
    got, twin = json.loads(image.value), json.loads(text.value)
    assert image.dead_code is None and image.topic == "results"
    assert got["audit"]["images"] == [
        {"field": f, "sha256": sha(data), "source": "inline", "url": None} for f, data in expected
    ]
    assert "images" not in twin["audit"]
    # The same text prompt and reads (samples 1), and each image's block on every read.
    reads = got["diagnostics"]["reads"]
    assert reads == twin["diagnostics"]["reads"]
    extra = reads * IMAGE_TOKENS * len(expected)
    assert got["diagnostics"]["input_tokens"] == twin["diagnostics"]["input_tokens"] + extra

    s = pipeline(output_format="openai_moderation", moderation={"categories": {"sexual": "toxic"}})
    text_m, image_m = (
        json.loads(o.value)["results"][0]
        for o in through(seeing, s, [{"id": "t"}, {"id": "i", **body}])
    )
    assert image_m["category_applied_input_types"]["sexual"] == ["text", "image"]
    assert text_m["category_applied_input_types"]["sexual"] == ["text"]
    assert image_m["category_applied_input_types"]["violence"] == []


@pytest.mark.model
def test_routes_read_the_answers_of_a_request_with_images(seeing: Classifier) -> None:
    routes = [
        Route(name="toxic", when='toxic.label == "yes"', topic="moderation.toxic"),
        Route(name="severe", when="severity.expected_score >= 2.5", topic="moderation.severe"),
    ]
    s = pipeline(routes=routes)
    bodies = [{"id": "image", "images": [data_url(JPEG, "image/jpeg")]}, {"id": "text"}]
    outs = through(seeing, s, bodies)
    for out in outs:
        value = json.loads(out.value)
        answers = value["answers"]
        if answers["toxic"]["label"] == "yes":
            want = ("toxic", "moderation.toxic")
        elif answers["severity"]["expected_score"] >= 2.5:
            want = ("severe", "moderation.severe")
        else:
            want = ("default", "results")
        assert (out.route, out.topic) == want
        assert (value["audit"]["route"], dict(out.headers)["route"]) == (want[0], want[0].encode())
    assert json.loads(outs[0].value)["audit"]["images"][0]["sha256"] == sha(JPEG)
    # The image moved the read: the answers are the engine's, not the text twin's.
    assert json.loads(outs[0].value)["answers"] != json.loads(outs[1].value)["answers"]


@pytest.mark.model
@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    colours=st.lists(
        st.tuples(st.integers(0, 255), st.integers(0, 255), st.integers(0, 255)), max_size=4
    ),
    sizes=st.lists(st.tuples(st.integers(1, 40), st.integers(1, 40)), min_size=4, max_size=4),
)
def test_any_images_are_named_in_order_and_counted(
    seeing: Classifier, colours: list[tuple[int, int, int]], sizes: list[tuple[int, int]]
) -> None:
    files = [png(size, colour) for size, colour in zip(sizes, colours, strict=False)]
    body = {"id": "p", "images": [data_url(f) for f in files]} if files else {"id": "p"}
    (out, twin) = through(seeing, pipeline(), [body, {"id": "p"}])
    got, plain = json.loads(out.value), json.loads(twin.value)
    if files:
        assert [i["sha256"] for i in got["audit"]["images"]] == [sha(f) for f in files]
    else:
        assert "images" not in got["audit"]
        assert got["answers"] == plain["answers"]
    extra = got["diagnostics"]["reads"] * IMAGE_TOKENS * len(files)
    assert got["diagnostics"]["input_tokens"] == plain["diagnostics"]["input_tokens"] + extra


# --------------------------------------------------------------------------- a fetched image


class _Serve(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path.startswith("/img/signed"):  # a pre-signed URL: redirect to the object
            self.send_response(302)
            self.send_header("Location", f"/img/object.png?X-Amz-Signature={_SECRET}")
            self.end_headers()
            return
        if self.path.startswith("/img/object.png"):
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(RED)))
            self.end_headers()
            self.wfile.write(RED)
            return
        self.send_error(404)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Serve)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


@pytest.mark.model
def test_a_fetched_image_is_named_by_where_it_came_from_without_its_token(
    seeing: Classifier, server: str
) -> None:
    allow = ImageSettings(fetch_allow=[f"{server}/img/"], fetch_timeout_s=5)
    body = {"id": "u", "images": [data_url(BLUE), f"{server}/img/signed?token={_SECRET}"]}
    (out,) = through(seeing, pipeline(), [body], allow)
    assert out.dead_code is None, out.value
    assert json.loads(out.value)["audit"]["images"] == [
        {"field": "images.0", "sha256": sha(BLUE), "source": "inline", "url": None},
        {
            "field": "images.1",
            "sha256": sha(RED),
            "source": "url",
            "url": f"{server}/img/object.png",
        },
    ]
    assert _SECRET.encode() not in out.value


# --------------------------------------------------------------------------- dgstream ask


@pytest.mark.model
def test_ask_reads_a_request_with_images_on_an_engine_that_reads_them() -> None:
    from cli_runner import run_cli

    text = {"id": "ask-img", "state": "hello there", "questions": QUESTIONS, "samples": 1}
    image = {**text, "images": [data_url(RED), data_url(JPEG, "image/jpeg")]}
    plain = run_cli("ask", json.dumps(text), "--json", "--device", "cpu")
    seen = run_cli("ask", json.dumps(image), "--json", "--device", "cpu")
    assert plain.returncode == 0 and seen.returncode == 0, seen.stdout + seen.stderr
    got, twin = json.loads(seen.stdout), json.loads(plain.stdout)
    # Read with its two images: their blocks counted, and the answers moved.
    extra = got["diagnostics"]["reads"] * IMAGE_TOKENS * 2
    assert got["diagnostics"]["input_tokens"] == twin["diagnostics"]["input_tokens"] + extra
    assert got["answers"] != twin["answers"]
    # An engine that reads no images still refuses it, by its code.
    blind = run_cli("ask", json.dumps(image), "--backend", "fake")
    assert blind.returncode == 2
    assert json.loads(blind.stdout)["error"]["code"] == "IMAGES_NOT_READ"

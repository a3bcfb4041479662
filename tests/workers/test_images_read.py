"""The worker's step 7 with an engine that reads images: the gate lets a request's checked
images through to the transformers engine on the demo model (and its vision tower), which
answers it from its images and its text; the fake engine still refuses it
(IMAGES_NOT_READ); a hostile image is still refused whatever the engine; the requests
around them are answered as before."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from image_files import data_url, noisy_jpeg, png, png_bomb

from dgstream.schemas import ClassificationRequest, ClassificationResult, ErrorCode, RequestError
from dgstream.schemas import parse_request as _parse
from dgstream.workers.engine.classifier import Classifier
from dgstream.workers.engine.factory import EngineSettings, build_classifier
from dgstream.workers.images import ImageSettings, InputGate
from dgstream.workers.steps.classify import BatchClassifier

pytestmark = pytest.mark.model

E = ErrorCode
QUESTIONS = {
    "toxic": {"type": "yes_no", "instructions": "Is it toxic?"},
    "severity": {
        "type": "score",
        "instructions": "How severe is it?",
        "criteria": ["none", "mild", "moderate", "severe"],
    },
}


def request(body: dict[str, Any]) -> ClassificationRequest:
    got = _parse(json.dumps({"questions": QUESTIONS, **body}).encode())
    assert isinstance(got, ClassificationRequest), got
    return got


class _Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


@pytest.fixture(scope="module")
def seeing() -> Classifier:
    return build_classifier(EngineSettings(backend="transformers", model="demo", device="cpu"))


@pytest.fixture(scope="module")
def blind() -> Classifier:
    return build_classifier(EngineSettings(backend="fake"), {}, "t")


def run(classifier: Classifier, reqs: list[ClassificationRequest]) -> list[Any]:
    gate = InputGate(ImageSettings(), classifier.engine.info)
    step = BatchClassifier(classifier, 0, 0.0, _Log(), gate=gate)
    return asyncio.run(step.classify(reqs))


def probabilities(result: Any) -> dict[str, Any]:
    assert isinstance(result, ClassificationResult), result
    return {q: a.model_dump(include={"p_yes", "probabilities"}) for q, a in result.answers.items()}


def numbers(result: Any) -> list[float]:
    out: list[float] = []
    for a in probabilities(result).values():
        out += [a["p_yes"]] if a.get("p_yes") is not None else list(a["probabilities"].values())
    return out


_BLUE = data_url(png((32, 32), "blue"))
_NOISE = data_url(noisy_jpeg(), "image/jpeg")


def test_the_gate_passes_images_to_the_transformers_engine(seeing: Classifier) -> None:
    assert seeing.engine.info.backend == "transformers" and seeing.engine.info.reads_images
    plain = [request({"id": f"p{i}", "state": f"text number {i}"}) for i in range(2)]
    state = "a picture someone posted"
    blue = request({"id": "blue", "state": state, "images": [_BLUE]})
    noise = request({"id": "noise", "state": state, "images": [_NOISE]})
    both = request({"id": "both", "state": state, "images": [_BLUE, _NOISE]})
    bare = request({"id": "bare", "state": state})
    bomb = request({"id": "bomb", "state": state, "images": [data_url(png_bomb(10**5, 10**5))]})
    out = run(seeing, [plain[0], blue, noise, bomb, both, plain[1], bare])
    codes = [getattr(o, "code", None) for o in out]
    assert codes == [None, None, None, E.IMAGE_TOO_LARGE, None, None, None]
    got = {o.id: probabilities(o) for o in out if isinstance(o, ClassificationResult)}
    # Read from its images: not the text-only answer, and each image its own.
    assert got["blue"] != got["bare"] and got["noise"] != got["bare"]
    assert got["blue"] != got["noise"] and got["both"] not in (got["blue"], got["noise"])
    # The text requests are answered as in a batch without images: the same labels, and
    # probabilities within the engine's batch tolerance (1e-5, fp32: batching changes the
    # summation order only; tests/workers/engine/test_hf_images.py) plus the result's
    # rounding to 6 decimals.
    alone = run(seeing, plain)
    for a, b in zip(alone, (out[0], out[5]), strict=True):
        assert numbers(a) == pytest.approx(numbers(b), abs=2e-5)
        assert [
            x.model_dump(exclude={"confidence", "p_yes", "probabilities", "expected_score"})
            for x in a.answers.values()
        ] == [
            x.model_dump(exclude={"confidence", "p_yes", "probabilities", "expected_score"})
            for x in b.answers.values()
        ]


def test_the_fake_engine_still_refuses_images(blind: Classifier) -> None:
    assert not blind.engine.info.reads_images
    out = run(blind, [request({"id": "img", "state": "x", "images": [_BLUE]})])
    assert isinstance(out[0], RequestError) and out[0].code is E.IMAGES_NOT_READ


def test_the_classifier_never_answers_images_it_was_not_given(
    seeing: Classifier, blind: Classifier
) -> None:
    # A caller that skips the gate (or loses the images) gets a refusal, not an answer
    # from the text alone.
    req = request({"id": "img", "state": "x", "images": [_BLUE]})
    for classifier in (seeing, blind):
        (got,) = asyncio.run(classifier.classify([req]))
        assert isinstance(got, RequestError) and got.code is E.IMAGES_NOT_READ


def test_the_gate_hands_on_the_checked_images_in_order(seeing: Classifier) -> None:
    gate = InputGate(ImageSettings(), seeing.engine.info)
    req = request({"id": "two", "state": "x", "images": [_BLUE, _NOISE]})
    outcome = asyncio.run(gate.check([request({"id": "t", "state": "y"}), req]))
    assert outcome.refused == {} and list(outcome.images) == [1]
    first, second = outcome.images[1]
    assert first.image.size == (32, 32) and first.image.mode == "RGB"
    assert second.image.size == (64, 64) and first.sha256 != second.sha256

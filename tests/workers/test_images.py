"""A request's images in the worker: each hostile case refused with its code, the good ones
decoded to plain RGB, and a request with images never answered from its text alone
(IMAGES_NOT_READ) while the requests beside it are answered as before."""

from __future__ import annotations

import asyncio
import base64
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from image_files import (
    animated_gif,
    cmyk_jpeg,
    data_url,
    exif_rotated_jpeg,
    grey16_png,
    noisy_jpeg,
    png,
    png_bomb,
    save,
)
from PIL import Image

from dgstream.schemas import ClassificationRequest, ClassificationResult, ErrorCode, RequestError
from dgstream.schemas import parse_request as _parse
from dgstream.workers.engine.factory import EngineSettings, build_classifier
from dgstream.workers.engine.types import EngineInfo
from dgstream.workers.images import ImageSettings, InputGate, check_images
from dgstream.workers.steps.classify import BatchClassifier

pytestmark = pytest.mark.unit

E = ErrorCode
QUESTIONS = {"toxic": {"type": "yes_no", "instructions": "Is it toxic?"}}
# What an engine that reads images would declare (none does yet): the gate then lets a
# request with good images through, so the table sees what the checks alone decide.
SEEING = EngineInfo("seeing", "seeing", 64, 2048, reads_images=True)
BLIND = EngineInfo("fake", "fake", 64, 2048)
IMAGE_CODES = {
    E.IMAGE_UNREADABLE,
    E.IMAGE_TRUNCATED,
    E.IMAGE_TOO_LARGE,
    E.IMAGE_URL_NOT_ALLOWED,
    E.IMAGE_FETCH_FAILED,
    E.IMAGE_FETCH_TIMEOUT,
    E.IMAGE_WRONG_CONTENT_TYPE,
}


def parse(body: dict[str, Any]) -> ClassificationRequest | RequestError:
    return _parse(json.dumps({"id": "r1", "questions": QUESTIONS, **body}).encode())


def request(body: dict[str, Any]) -> ClassificationRequest:
    got = parse(body)
    assert isinstance(got, ClassificationRequest), got
    return got


def refusal(req: ClassificationRequest, engine: EngineInfo, **kw: Any) -> RequestError | None:
    return asyncio.run(InputGate(ImageSettings(**kw), engine).refusals([req])).get(0)


_PNG = png()
_JPEG = noisy_jpeg()
# Large enough that half of it still holds the whole header.
_NOISY_PNG = save(Image.effect_noise((64, 64), 60).convert("RGB"), "PNG")

# (case, the request's extra fields, code with an engine that reads images (None: read),
# code with today's engines)
CASES = [
    ("png", {"images": [data_url(_PNG)]}, None, E.IMAGES_NOT_READ),
    ("jpeg", {"images": [data_url(_JPEG, "image/jpeg")]}, None, E.IMAGES_NOT_READ),
    ("not-an-image", {"images": [data_url(b"hello, world")]}, E.IMAGE_UNREADABLE, None),
    (
        "truncated-png",
        {"images": [data_url(_NOISY_PNG[: len(_NOISY_PNG) // 2])]},
        E.IMAGE_TRUNCATED,
        None,
    ),
    ("truncated-jpeg", {"images": [data_url(_JPEG[: len(_JPEG) // 2])]}, E.IMAGE_TRUNCATED, None),
    (
        "bomb-10-gigapixels",
        {"images": [data_url(png_bomb(100_000, 100_000))]},
        E.IMAGE_TOO_LARGE,
        None,
    ),
    ("bomb-81-megapixels", {"images": [data_url(png_bomb(9_000, 9_000))]}, E.IMAGE_TOO_LARGE, None),
    (
        "tiff",
        {"images": [data_url(save(Image.new("RGB", (4, 4)), "TIFF"))]},
        E.IMAGE_UNREADABLE,
        None,
    ),
    ("animated-gif", {"images": [data_url(animated_gif(), "image/gif")]}, None, E.IMAGES_NOT_READ),
    ("cmyk-jpeg", {"images": [data_url(cmyk_jpeg(), "image/jpeg")]}, None, E.IMAGES_NOT_READ),
    ("16-bit-png", {"images": [data_url(grey16_png())]}, None, E.IMAGES_NOT_READ),
    (
        "exif-rotated",
        {"images": [data_url(exif_rotated_jpeg(), "image/jpeg")]},
        None,
        E.IMAGES_NOT_READ,
    ),
    ("1x1", {"images": [data_url(png((1, 1)))]}, None, E.IMAGES_NOT_READ),
    ("url-fetching-off", {"images": ["https://example.com/a.png"]}, E.IMAGE_URL_NOT_ALLOWED, None),
    (
        "openai-input-parts",
        {
            "input": [
                {"type": "text", "text": "hi"},
                {"type": "image_url", "image_url": {"url": data_url(_PNG)}},
            ]
        },
        None,
        E.IMAGES_NOT_READ,
    ),
    (
        "openai-input-bad-image",
        {"input": [{"type": "image_url", "image_url": {"url": data_url(b"GIF89a")}}]},
        E.IMAGE_UNREADABLE,
        None,
    ),
    (
        "jev-asset",
        {
            "assets": {
                "<image:1>": {
                    "type": "image",
                    "format": "png",
                    "data_base64": base64.b64encode(_PNG).decode(),
                }
            }
        },
        None,
        E.IMAGES_NOT_READ,
    ),
    (
        "second-image-bad",
        {"images": [data_url(_PNG), data_url(b"\x89PNG\r\n\x1a\n")]},
        E.IMAGE_UNREADABLE,
        None,
    ),
]


@pytest.mark.parametrize(
    ("body", "seeing", "blind"), [pytest.param(*c[1:], id=c[0]) for c in CASES]
)
def test_each_case_is_refused_with_its_code_or_read(
    body: dict[str, Any], seeing: ErrorCode | None, blind: ErrorCode | None
) -> None:
    req = request({"state": "look", **body} if "input" not in body else body)
    got = refusal(req, SEEING)
    assert (got.code if got else None) is seeing, got
    if got is not None:
        assert got.field and got.field in got.message  # names the image (or field)
    # A hostile image is refused for what it is whatever the engine; a good one, by
    # today's engines, because none reads it.
    now = refusal(req, BLIND)
    assert now is not None and now.code is (blind or seeing), now


def test_request_level_instructions_pass_the_gate_with_any_engine() -> None:
    """Every engine's prompt places them (tests/workers/engine/test_instructions.py):
    INSTRUCTIONS_NOT_READ is reserved, no longer produced."""
    req = request({"state": "look", "instructions": "The sender is a child."})
    assert not InputGate.concerns(req)
    assert refusal(req, SEEING) is None
    assert refusal(req, BLIND) is None
    both = request({"state": "look", "instructions": "ctx", "images": [data_url(_PNG)]})
    assert refusal(both, SEEING) is None
    got = refusal(both, BLIND)
    assert got is not None and got.code is E.IMAGES_NOT_READ


def test_too_many_images_and_bad_sources_are_refused_when_parsed() -> None:
    many = parse(
        {
            "state": "x",
            "images": [data_url(_PNG)] * 5,
            "assets": {
                f"a{i}": {"type": "image", "data_base64": base64.b64encode(_PNG).decode()}
                for i in range(4)
            },
        }
    )
    assert isinstance(many, RequestError) and many.code is E.TOO_MANY_IMAGES
    bad = parse({"state": "x", "images": ["data:text/html;base64,PGI+"]})
    assert isinstance(bad, RequestError) and bad.code is E.INVALID_IMAGE_SOURCE


def test_good_images_come_out_as_plain_rgb() -> None:
    req = request(
        {
            "state": "x",
            "images": [
                data_url(cmyk_jpeg()),
                data_url(grey16_png(40_000)),
                data_url(exif_rotated_jpeg()),
                data_url(animated_gif()),
                data_url(png((1, 1), "white")),
            ],
        }
    )
    got = asyncio.run(check_images(req, ImageSettings(), keep=True))
    assert not isinstance(got, RequestError), got
    cmyk, grey, rotated, gif, dot = (c.decoded for c in got)
    for d in (cmyk, grey, rotated, gif, dot):
        assert d.image is not None and d.image.mode == "RGB"
    assert (
        cmyk.mode == "CMYK"
        and max(abs(a - b) for a, b in zip(cmyk.image.getpixel((4, 4)), (255, 0, 0), strict=True))
        < 8
    )
    # 16 bits scaled to 8, not clipped: 40000 / 256 = 156.
    assert grey.mode.startswith("I") and grey.image.getpixel((0, 0)) == (156, 156, 156)
    assert (rotated.width, rotated.height) == (10, 30) and rotated.exif_rotated
    assert gif.animated and gif.image.getpixel((5, 5)) == (255, 0, 0)  # the first frame
    assert (dot.width, dot.height) == (1, 1)
    audit = got[0].audit()
    assert audit["source"] == "inline" and audit["url"] is None and len(str(audit["sha256"])) == 64


def test_inline_bytes_are_decoded_once() -> None:
    """The parse's base64 check keeps the bytes it decoded: the gate reads those (a second
    decode cost 0.6 ms of a 200 KB image's 5.6 ms), for data URLs and Jev assets alike."""
    asset = {"type": "image", "format": "png", "data_base64": base64.b64encode(_PNG).decode()}
    req = request({"state": "x", "images": [data_url(_PNG)], "assets": {"a": asset}})
    refs = req.image_refs
    assert len(refs) == 2
    for ref in refs:
        assert ref.data() == _PNG and ref.data() is ref.data()


def test_the_pixel_cap_is_read_from_the_header_before_decoding() -> None:
    # 49 megapixels named in the header, a few hundred bytes of data: at a cap of one
    # megapixel nothing is decoded (a decode would allocate 147 MB and then fail).
    req = request({"state": "x", "images": [data_url(png_bomb(7_000, 7_000))]})
    got = refusal(req, SEEING, max_pixels=1_000_000)
    assert got is not None and got.code is E.IMAGE_TOO_LARGE and "before decoding" in got.message


def test_a_batch_with_images_answers_the_rest_as_before() -> None:
    classifier = build_classifier(EngineSettings(backend="fake"), {}, "t")
    plain = [request({"id": f"p{i}", "state": f"text {i}"}) for i in range(3)]
    with_image = request({"id": "img", "state": "x", "images": [data_url(_PNG)]})
    hostile = request(
        {"id": "bomb", "state": "x", "images": [data_url(png_bomb(100_000, 100_000))]}
    )
    batch = [plain[0], with_image, plain[1], hostile, plain[2]]

    def run(reqs: list[ClassificationRequest], gate: InputGate | None) -> list[Any]:
        step = BatchClassifier(classifier, 0, 0.0, _Log(), gate=gate)
        return asyncio.run(step.classify(reqs))

    gate = InputGate(ImageSettings(), classifier.engine.info)
    out = run(batch, gate)
    assert [getattr(o, "code", None) for o in out] == [
        None,
        E.IMAGES_NOT_READ,
        None,
        E.IMAGE_TOO_LARGE,
        None,
    ]
    alone = run(plain, None)
    answered = [o for o in out if isinstance(o, ClassificationResult)]
    assert [r.model_dump(exclude={"diagnostics"}) for r in answered] == [
        r.model_dump(exclude={"diagnostics"}) for r in alone
    ]


class _Log:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


# --- property: whatever the bytes, a code or an RGB image, never an exception ----------------

_SEEDS = [_PNG, _JPEG, animated_gif(), cmyk_jpeg(), grey16_png(), exif_rotated_jpeg()]


@st.composite
def _mangled(draw: st.DrawFn) -> bytes:
    """A real image cut, flipped or spliced, or bytes of no kind at all."""
    if draw(st.booleans()):
        return draw(st.binary(max_size=512))
    data = bytearray(draw(st.sampled_from(_SEEDS)))
    for _ in range(draw(st.integers(0, 4))):
        at = draw(st.integers(0, len(data) - 1))
        data[at] = draw(st.integers(0, 255))
    cut = draw(st.integers(1, len(data)))
    return bytes(data[:cut])


@settings(
    database=None, deadline=None, max_examples=300, suppress_health_check=[HealthCheck.too_slow]
)
@given(data=_mangled(), width=st.integers(1, 5000), height=st.integers(1, 5000))
def test_any_bytes_give_a_code_or_an_rgb_image(data: bytes, width: int, height: int) -> None:
    limits = ImageSettings(max_pixels=1_000_000)
    for blob in (data, png_bomb(width, height)):
        req = parse({"state": "x", "images": [data_url(blob)]})
        if not blob:  # a data URL without data is no image source at all
            assert isinstance(req, RequestError) and req.code is E.INVALID_IMAGE_SOURCE
            continue
        assert isinstance(req, ClassificationRequest), req
        got = asyncio.run(check_images(req, limits, keep=True))
        if isinstance(got, RequestError):
            assert got.code in IMAGE_CODES and got.field == "images.0"
        else:
            (img,) = got
            assert img.decoded.image is not None and img.decoded.image.mode == "RGB"
            assert img.decoded.width * img.decoded.height <= 1_000_000
    # The header's size decides before any decoding.
    bomb = asyncio.run(
        check_images(request({"state": "x", "images": [data_url(png_bomb(width, height))]}), limits)
    )
    too_large = isinstance(bomb, RequestError) and bomb.code is E.IMAGE_TOO_LARGE
    assert too_large == (width * height > 1_000_000)


def test_the_clients_image_bytes_go_inline_as_a_data_url_the_worker_reads() -> None:
    from dgstream.client import image_data_url

    for blob in (_PNG, _JPEG, animated_gif()):
        req = request({"state": "x", "images": [image_data_url(blob)]})
        got = asyncio.run(check_images(req, ImageSettings()))
        assert not isinstance(got, RequestError), got

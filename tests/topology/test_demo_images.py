"""The image demo family (topology/demo_tasks/images.py): deterministic from a seed, its truth
what the picture shows AFTER the engine's preprocessing (the drawn attributes are read back
from the 32 x 32 pixels the tower sees), its requests valid and passed by the image gate."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections import deque
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image, ImageDraw

from dgstream.schemas import RequestError, parse_request
from dgstream.topology import demo_tasks
from dgstream.topology.demo_tasks import images
from dgstream.workers.engine.types import EngineInfo
from dgstream.workers.engine.vision import image_patches
from dgstream.workers.images.decode import decode_image
from dgstream.workers.images.gate import InputGate
from dgstream.workers.images.settings import ImageSettings

pytestmark = pytest.mark.unit

_SEEDS = st.one_of(
    st.integers(0, demo_tasks.HELD_OUT_BASE - 1),
    st.integers(demo_tasks.HELD_OUT_BASE, demo_tasks.HELD_OUT_BASE + (1 << 34)),
)


def _seen(data_url: str) -> np.ndarray:
    """The 32 x 32 RGB picture the demo tower sees: the gate's decoding, then the engine's
    resize and patch cut (`image_patches`, patch 4, 8 a side), put back together."""
    import base64

    raw = base64.b64decode(data_url.split(",", 1)[1])
    decoded = decode_image(raw, ImageSettings().max_pixels, keep=True)
    pixels, _ = image_patches(decoded.image, 4, 8)
    cut = pixels.reshape(8, 8, 4, 4, 3).transpose(0, 2, 1, 3, 4)
    return np.asarray(cut.reshape(32, 32, 3) * 255.0)


def _components(mask: np.ndarray) -> list[list[tuple[int, int]]]:
    seen = np.zeros_like(mask, dtype=bool)
    out = []
    for y, x in zip(*np.nonzero(mask), strict=True):
        if seen[y, x]:
            continue
        todo, comp = deque([(y, x)]), []
        seen[y, x] = True
        while todo:
            cy, cx = todo.popleft()
            comp.append((cy, cx))
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < 32 and 0 <= nx < 32 and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    todo.append((ny, nx))
        out.append(comp)
    return out


def _nearest_colour(rgb: np.ndarray) -> str:
    return min(
        images.COLOURS, key=lambda c: float(np.sum((np.array(images.COLOURS[c]) - rgb) ** 2))
    )


def _shape_of(comp: list[tuple[int, int]], dist: np.ndarray, full: float) -> str:
    """The shape a component looks like, from its coverage (distance from the background over
    its colour's) in the box of its pixels at least half covered. Thresholds from the shapes
    of seeds 0..19999 (each feature's range by shape kept apart): a triangle's mass is skewed
    down (skew < -0.35, the others > -0.24); a cross has empty corners (< 0.02) and mass far
    from its centre (inertia/area^2 >= 0.169, a circle's <= 0.165); a square's corners are
    covered (> 0.24, a circle's < 0.19)."""
    half = [p for p in comp if dist[p] > 0.5 * full]
    ys, xs = zip(*half, strict=True)
    cov = np.clip(dist[min(ys) : max(ys) + 1, min(xs) : max(xs) + 1] / full, 0, 1)
    total = cov.sum()
    yy, xx = np.mgrid[0 : cov.shape[0], 0 : cov.shape[1]]
    cy, cx = (cov * yy).sum() / total, (cov * xx).sum() / total
    ryy = (cov * (yy - cy) ** 2).sum() / total
    inertia = (ryy + (cov * (xx - cx) ** 2).sum() / total) / total
    skew = (cov * (yy - cy) ** 3).sum() / total / ryy**1.5
    corners = (cov[0, 0] + cov[0, -1] + cov[-1, 0] + cov[-1, -1]) / 4
    if skew < -0.3:
        return "triangle"
    if inertia > 0.167 and corners < 0.1:
        return "cross"
    return "square" if corners > 0.215 else "circle"


def _read(scene: images.Scene, px: np.ndarray) -> dict[str, Any]:
    bg = np.array(scene.background, dtype=float)
    dist = np.abs(px - bg).sum(-1)
    # Under half the smallest contrast of a shape colour or an ink against a background
    # (261): a shape's faint anti-aliased rim may fall below it, its body never, and
    # neighbours stay apart.
    comps = _components(dist > 120)
    out: dict[str, Any] = {"count": len(comps)}
    cores = [px[max(c, key=lambda p: float(dist[p]))] for c in comps]
    out["colours"] = sorted(_nearest_colour(c) for c in cores)
    out["dark"] = bool(comps) and all(float(c.max()) < 120 for c in cores)
    shapes = set()
    if scene.kind == "shapes":
        for comp, core in zip(comps, cores, strict=True):
            colour = np.array(images.COLOURS[_nearest_colour(core)], dtype=float)
            shapes.add(_shape_of(comp, dist, float(np.abs(colour - bg).sum())))
    out["shapes"] = sorted(shapes)
    return out


def _word_mask(scene: images.Scene) -> np.ndarray:
    im = Image.new("L", (32, 32), 0)
    ImageDraw.Draw(im).text(scene.word_at, scene.word or "", fill=255, font=images._bitmap_font())
    return np.asarray(im) > 127


@settings(max_examples=150, deadline=None)
@given(_SEEDS)
def test_the_truth_is_what_the_tower_sees(seed: int) -> None:
    ex = images.image_example(seed)
    (scene,) = ex.scenes
    px = _seen(ex.request["images"][0])
    got = _read(scene, px)
    if scene.kind == "shapes":
        assert got["count"] == scene.count
        assert got["colours"] == sorted(scene.colours)
        assert not got["dark"]
        assert got["shapes"] == [scene.shape]
    else:
        bg = np.array(scene.background, dtype=float)
        contrast = float(np.abs(np.array(scene.ink, dtype=float) - bg).sum())
        # Half the ink's contrast: a 64-pixel card's letters blur a little into their
        # neighbours on the way down to 32.
        ink = np.abs(px - bg).sum(-1) > 0.5 * contrast
        drawn = _word_mask(scene)
        assert (ink & drawn).sum() >= 0.8 * drawn.sum()  # the word is where it was drawn
        assert (ink & ~drawn).sum() <= 0.1 * drawn.sum()  # and nothing else
        assert got["dark"]
    for qid, truth in ex.truth.items():
        q = ex.tasks[qid]
        wire = ex.request["questions"][qid]
        if q.task not in images.IMAGE_KIND_OF:
            assert truth == demo_tasks.truth_of(ex.request["state"], q, wire)
            continue
        assert truth == images.image_truth(scene, q, wire)
        if q.task == "image_colour_present":
            drawn = got["colours"] if scene.kind == "shapes" else []  # ink has no colour
            assert (truth == "yes") == (q.colour in drawn)
        elif q.task == "image_count":
            levels = wire["criteria"]
            assert truth == levels[demo_tasks.bucket(got["count"], q.bounds)]
        elif q.task == "image_colour":
            assert got["colours"] == [truth] * got["count"]
        elif q.task == "image_insult":
            assert (truth == "yes") == (scene.word in demo_tasks.INSULTS)
        elif q.task == "image_has_word":
            assert (truth == "yes") == got["dark"]
        if wire["type"] in ("choice", "score"):
            assert truth in wire["criteria"]


def test_same_seed_same_bytes_in_another_process() -> None:
    seeds = [0, 7, 12345, demo_tasks.HELD_OUT_BASE + 3]
    here = json.dumps([images.image_example(s).request for s in seeds], sort_keys=True)
    code = (
        "import json, sys; from dgstream.topology.demo_tasks import images; "
        f"sys.stdout.write(json.dumps([images.image_example(s).request for s in {seeds}], "
        "sort_keys=True))"
    )
    there = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={"PYTHONHASHSEED": "123", "PATH": ""},
        cwd=str(__import__("pathlib").Path(__file__).resolve().parents[2]),
    ).stdout
    assert here == there
    assert images.image_example(5).request != images.image_example(6).request


def test_requests_parse_and_pass_the_image_gate() -> None:
    examples = images.held_out_image_examples(0, 120)
    parsed = []
    for ex in examples:
        got = parse_request(json.dumps(ex.request).encode())
        assert not isinstance(got, RequestError), (ex.request["id"], got)
        parsed.append(got)
    with_images = [p for p in parsed if p.image_refs]
    assert 0.6 * len(parsed) < len(with_images) < len(parsed)  # mixed with text-only ones
    info = EngineInfo("transformers", "demo", 64, 2048, reads_images=True, image_tokens=66)
    outcome = asyncio.run(InputGate(ImageSettings(), info).check(parsed))
    assert outcome.refused == {}
    for i, p in enumerate(parsed):
        if p.image_refs:
            (im,) = outcome.images[i]
            assert im.image.size in {(s, s) for s in images.SEND_SIZES}


def test_every_kind_and_task_is_asked_and_answers_are_balanced() -> None:
    truths: dict[str, list[str]] = {t: [] for t in images.IMAGE_QUESTION_TYPES}
    for ex in images.held_out_image_examples(0, 600):
        for qid, q in ex.tasks.items():
            if q.task in truths:
                truths[q.task].append(ex.truth[qid])
    for task, got in truths.items():
        assert len(got) >= 40, task
        top = max(got.count(a) for a in set(got))
        assert top / len(got) < 0.75, (task, {a: got.count(a) for a in set(got)})


def test_held_out_never_meets_training_and_check_knows_the_image_tasks() -> None:
    assert all(s >= demo_tasks.HELD_OUT_BASE for s in demo_tasks.held_out_seeds(0, 10))
    examples = images.held_out_image_examples(0, 40)
    perfect = []
    for ex in examples:
        answers = {}
        for qid, want in ex.truth.items():
            wire = ex.request["questions"][qid]
            if wire["type"] in ("noul", "yes_no"):
                answers[qid] = {"type": "yes_no", "label": want, "confidence": 1.0}
            elif wire["type"] == "choice":
                answers[qid] = {"type": "choice", "choice": want, "confidence": 1.0}
            else:
                answers[qid] = {"type": "score", "level": want, "confidence": 1.0}
        perfect.append({"answers": answers})
    reads = demo_tasks.score_results(examples, perfect)
    report = demo_tasks.check([r for r in reads if r.task in images.IMAGE_KIND_OF])
    assert report.passed and set(report.task_accuracy) == set(images.IMAGE_QUESTION_TYPES)


def test_sample_image_events_carry_their_truth() -> None:
    events = images.sample_image_events(3)
    assert [e["id"] for e in events] == [f"image-event-0-{i:05d}" for i in range(3)]
    for e in events:
        assert set(e["metadata"]["truth"]) == set(e["questions"])
        assert len(e["images"]) == 1

"""The image demo family: pictures drawn with Pillow from a seed (shapes of a colour, a count
of them, or a short word such as an insult), questions about them of the product's three
kinds, and the truth known from how each picture was drawn (docs/images.md, "The image demo
family").

An image request is a text request of the family (`generate.example(seed)`: its state and
0..3 of its questions) with ONE picture in `images` (a PNG data URL) and 1..3 questions
about it; `family_example` mixes in text-only requests. Seeds follow the text family:
training seeds below `HELD_OUT_BASE`, held-out ones at or above it.

Why 32 x 32: it is what the demo tower sees (`workers.engine.vision`: an 8 x 8 grid of
patches of 4 pixels, whatever the image's size). A picture is drawn for that square (shapes
drawn 4 x larger and box-filtered down, so their edges are smooth; words in Pillow's bitmap
font, 6 x 11 pixels a letter, crisp only at its own size), then sent at 32 or 64 pixels a
side (`SEND_SIZES`) so that the engine's resize is exercised too. Words have at most 5
letters: 30 pixels in that font, the widest that fits 32.
"""

from __future__ import annotations

import base64
import io
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageDraw, ImageFont

from dgstream.topology.demo_tasks.generate import Example, example, held_out_seeds
from dgstream.topology.demo_tasks.truth import TaskQuestion, bucket
from dgstream.topology.demo_tasks.words import ENGLISH, INSULTS, MAX_QUESTIONS

__all__ = [
    "COLOURS",
    "IMAGE_KIND_OF",
    "IMAGE_QUESTION_TYPES",
    "IMAGE_SIDE",
    "SEND_SIZES",
    "SHAPES",
    "TEXT_ONLY_SHARE",
    "WORD_INSULTS",
    "WORD_OTHERS",
    "ImageExample",
    "Scene",
    "draw",
    "family_example",
    "held_out_image_examples",
    "image_example",
    "image_truth",
    "sample_image_events",
]

IMAGE_SIDE = 32  # the demo tower's input square (vision.IMAGE_GRID 8 x patch 4)
SEND_SIZES = (32, 64)  # 64: the engine resizes it (bicubic) to 32, as it does real photos
_SUPERSAMPLE = 4  # shapes are drawn at 128 px and box-filtered: anti-aliased edges

# Saturated, far apart in RGB and from the light backgrounds and the dark ink, so each stays
# its nearest palette colour after the resize (tests/topology/test_demo_images.py).
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (215, 40, 40),
    "green": (40, 150, 60),
    "blue": (40, 80, 215),
    "yellow": (230, 185, 20),
}
_BACKGROUNDS = ((255, 255, 255), (232, 232, 232), (248, 240, 220))
_INKS = ((20, 20, 20), (70, 70, 70))
SHAPES = ("circle", "square", "triangle", "cross")

# Words a picture may show: 5 letters at most (see the module's docstring).
WORD_INSULTS = tuple(w for w in INSULTS if len(w) <= 5)
WORD_OTHERS = tuple(w for w in ENGLISH if 3 <= len(w) <= 5)

# The image question types, by kind; score schemes as the text family's (levels, bounds).
IMAGE_KIND_OF = {
    "image_colour_present": "yes_no",
    "image_insult": "yes_no",
    "image_has_word": "yes_no",
    "image_shape": "choice",
    "image_colour": "choice",
    "image_count": "score",
}
IMAGE_QUESTION_TYPES = tuple(IMAGE_KIND_OF)
_COUNT_SCHEMES: tuple[tuple[tuple[str, ...], tuple[int, ...]], ...] = (
    (("one", "two", "three", "four", "five"), (1, 2, 3, 4)),
    (("one", "two", "three or more"), (1, 2)),
)
_MAX_SHAPES = 5  # the brief's scale, 1..5 (a 3 x 3 grid of 10.7-pixel cells holds 5)

_WORDINGS: dict[str, tuple[str, ...]] = {
    "image_colour_present": (
        "Is there a {c} shape in the image?",
        "Does the picture show a {c} shape?",
        "Is any shape in the image {c}?",
    ),
    "image_insult": (
        "Does the image contain an insult?",
        "Is an insult word written in the image?",
        "Does the picture show an insult?",
    ),
    "image_has_word": (
        "Is there a word written in the image?",
        "Does the picture show a word?",
    ),
    "image_shape": (
        "Which shape is in the image?",
        "What shape does the picture show?",
    ),
    "image_colour": (
        "What colour are the shapes in the image?",
        "Which colour are the shapes in the picture?",
    ),
    "image_count": (
        "How many shapes are in the image?",
        "Count the shapes in the picture.",
    ),
}
_IDS: dict[str, tuple[str, ...]] = {
    "image_colour_present": ("has_{c}", "{c}_shape", "image_{c}"),
    "image_insult": ("image_insult", "rude_image", "picture_insult"),
    "image_has_word": ("has_word", "image_text", "word_shown"),
    "image_shape": ("shape", "image_shape", "figure"),
    "image_colour": ("colour", "color", "shape_colour"),
    "image_count": ("shapes", "shape_count", "how_many"),
}
# A share of `family_example`'s requests are the text family's own, text only, so a held-out
# split also checks the text figures on requests beside image ones (docs/images.md).
TEXT_ONLY_SHARE = 0.25


@dataclass(frozen=True)
class Scene:
    """What a picture shows, as drawn: the truth of every image question comes from here."""

    kind: str  # "shapes" or "word"
    shape: str | None = None  # every shape of a scene is of one kind
    colours: tuple[str, ...] = ()  # one per shape
    boxes: tuple[tuple[float, float, float, float], ...] = ()  # in 32-pixel units
    word: str | None = None
    word_at: tuple[int, int] = (0, 0)
    background: tuple[int, int, int] = (255, 255, 255)
    ink: tuple[int, int, int] = (20, 20, 20)
    send_size: int = IMAGE_SIDE

    @property
    def count(self) -> int:
        return len(self.colours)

    @property
    def insult(self) -> bool:
        return self.word in INSULTS


@dataclass(frozen=True)
class ImageExample(Example):
    """An `Example` with the scene of each image, in request order."""

    scenes: tuple[Scene, ...] = ()


# --------------------------------------------------------------------------- scenes


def _scene(rng: random.Random) -> Scene:
    background = rng.choice(_BACKGROUNDS)
    send_size = rng.choice(SEND_SIZES)
    if rng.random() < 0.3:
        word = rng.choice(WORD_INSULTS) if rng.random() < 0.5 else rng.choice(WORD_OTHERS)
        w, h = 6 * len(word), 11  # the bitmap font's cell
        at = (rng.randint(0, IMAGE_SIDE - w), rng.randint(0, IMAGE_SIDE - h))
        return Scene(
            "word",
            word=word,
            word_at=at,
            background=background,
            ink=rng.choice(_INKS),
            send_size=send_size,
        )
    n = rng.randint(1, _MAX_SHAPES)
    if rng.random() < 0.6:
        colours = (rng.choice(tuple(COLOURS)),) * n
    else:
        colours = tuple(rng.choice(tuple(COLOURS)) for _ in range(n))
    # Up to 4 shapes on a 2 x 2 grid of 16-pixel cells, 9 to 12 pixels each (2 to 3 of the
    # tower's 4-pixel patches a side: as large as the grid allows); 5 need the 3 x 3 grid,
    # 7.5 to 8.8 pixels each. At least 1.5 (0.9) pixels from a cell's edges: shapes stay
    # apart after the box filter and the engine's bicubic resize. At these sizes a reader of
    # the 32 x 32 pixels tells the four kinds apart in every one of 18,000 pictures
    # (tests/topology/test_demo_images.py's reader, seeds 0..19999 and 6,000 held out).
    cells, (low, high), margin = (2, (9.0, 12.0), 1.5) if n <= 4 else (3, (7.5, 8.8), 0.9)
    cell = IMAGE_SIDE / cells
    boxes = []
    for c in rng.sample(range(cells * cells), n):
        size = rng.uniform(low, high)
        x0 = (c % cells) * cell + rng.uniform(margin, cell - margin - size)
        y0 = (c // cells) * cell + rng.uniform(margin, cell - margin - size)
        boxes.append((x0, y0, x0 + size, y0 + size))
    return Scene(
        "shapes",
        shape=rng.choice(SHAPES),
        colours=colours,
        boxes=tuple(boxes),
        background=background,
        send_size=send_size,
    )


def _draw_shape(d: ImageDraw.ImageDraw, shape: str, box: Sequence[float], fill: Any) -> None:
    x0, y0, x1, y1 = (v * _SUPERSAMPLE for v in box)
    w = x1 - x0
    if shape == "circle":
        d.ellipse((x0, y0, x1, y1), fill=fill)
    elif shape == "square":
        d.rectangle((x0, y0, x1, y1), fill=fill)
    elif shape == "triangle":
        d.polygon(((x0 + w / 2, y0), (x1, y1), (x0, y1)), fill=fill)
    else:  # cross: a plus of arms a third of the box wide
        t = w / 3
        d.rectangle((x0 + t, y0, x1 - t, y1), fill=fill)
        d.rectangle((x0, y0 + t, x1, y1 - t), fill=fill)


def _bitmap_font() -> Any:
    # Pillow 10.1 named it load_default_imagefont; before, load_default returned it.
    return getattr(ImageFont, "load_default_imagefont", ImageFont.load_default)()


def draw(scene: Scene) -> Image.Image:
    """The picture of `scene`, RGB, `scene.send_size` pixels a side."""
    if scene.kind == "word":
        im = Image.new("RGB", (IMAGE_SIDE, IMAGE_SIDE), scene.background)
        assert scene.word is not None
        # The bitmap font is pixel-exact on every platform (a TrueType font would vary with
        # the FreeType build); upscaled by nearest neighbour it stays crisp.
        ImageDraw.Draw(im).text(scene.word_at, scene.word, fill=scene.ink, font=_bitmap_font())
        if scene.send_size != IMAGE_SIDE:
            im = im.resize((scene.send_size,) * 2, Image.Resampling.NEAREST)
        return im
    big = IMAGE_SIDE * _SUPERSAMPLE
    im = Image.new("RGB", (big, big), scene.background)
    d = ImageDraw.Draw(im)
    assert scene.shape is not None
    for colour, box in zip(scene.colours, scene.boxes, strict=True):
        _draw_shape(d, scene.shape, box, COLOURS[colour])
    return im.resize((scene.send_size,) * 2, Image.Resampling.BOX)


def png_bytes(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, "PNG")  # zlib at Pillow's default level: the same bytes for the same pixels
    return buf.getvalue()


def data_url(im: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(im)).decode("ascii")


# --------------------------------------------------------------------------- questions


def _tasks_for(rng: random.Random, scene: Scene) -> list[str]:
    # A question whose answer is always no for the scene's kind (a colour of a word card, an
    # insult among shapes) is asked of a quarter of them: its answers stay near half yes
    # (tests/topology/test_demo_images.py).
    if scene.kind == "word":
        extra = ["image_colour_present"] if rng.random() < 0.25 else []
        return ["image_insult", "image_has_word", *extra]
    tasks = ["image_colour_present", "image_has_word", "image_shape"]
    tasks += ["image_count"] * 2  # counting is the hardest: asked twice as often
    if len(set(scene.colours)) == 1:
        tasks.append("image_colour")
    if rng.random() < 0.25:
        tasks.append("image_insult")
    return tasks


def _image_question(rng: random.Random, task: str, scene: Scene) -> tuple[TaskQuestion, dict, str]:
    """(the generator's view, the wire question, its id's template filled)."""
    wording = rng.choice(_WORDINGS[task])
    qid = rng.choice(_IDS[task])
    if task in ("image_colour_present", "image_insult", "image_has_word"):
        colour = None
        if task == "image_colour_present":
            present = sorted(set(scene.colours))
            absent = [c for c in COLOURS if c not in present]
            # About half yes: a colour drawn, or one that is not.
            pick = present if present and (not absent or rng.random() < 0.5) else absent
            colour = rng.choice(pick)
        wire: dict[str, Any] = {
            "type": rng.choice(("noul", "yes_no")),
            "instructions": wording.format(c=colour),
        }
        return TaskQuestion(task, colour=colour), wire, qid.format(c=colour)
    if task in ("image_shape", "image_colour"):
        universe = SHAPES if task == "image_shape" else tuple(COLOURS)
        actual = str(scene.shape if task == "image_shape" else scene.colours[0])
        others = [o for o in universe if o != actual]
        options = [actual, *rng.sample(others, rng.randint(1, len(others)))]
        rng.shuffle(options)
        wire = {"type": "choice", "instructions": wording, "criteria": dict.fromkeys(options)}
        return TaskQuestion(task), wire, qid
    levels, bounds = rng.choice(_COUNT_SCHEMES)
    wire = {"type": "score", "instructions": wording, "criteria": list(levels)}
    return TaskQuestion(task, bounds=bounds), wire, qid


def image_truth(scene: Scene, q: TaskQuestion, question: dict[str, Any]) -> str:
    """The answer name of image question `question` (wire form) about `scene`."""
    if q.task == "image_colour_present":
        return "yes" if q.colour in scene.colours else "no"
    if q.task == "image_insult":
        return "yes" if scene.insult else "no"
    if q.task == "image_has_word":
        return "yes" if scene.kind == "word" else "no"
    if q.task == "image_shape":
        if scene.shape is None:
            raise ValueError("a shape question needs a picture of shapes")
        return scene.shape
    if q.task == "image_colour":
        if len(set(scene.colours)) != 1:
            raise ValueError("a colour question needs shapes of one colour")
        return scene.colours[0]
    if q.task == "image_count":
        if scene.kind != "shapes":
            raise ValueError("a count question needs a picture of shapes")
        return str(question["criteria"][bucket(scene.count, q.bounds)])
    raise ValueError(f"unknown image task {q.task!r}")


# --------------------------------------------------------------------------- requests


def image_example(seed: int) -> ImageExample:
    """An image request for `seed`: the text family's request of the same seed (its state,
    0..3 of its questions) with one picture and 1..3 questions about it; from
    `random.Random(("image", seed))` and `example(seed)` alone."""
    rng = random.Random(f"image/{seed}")
    text = example(seed)
    scene = _scene(rng)
    n_image = rng.randint(1, 3 if scene.kind == "shapes" else 2)
    tasks = rng.sample(_tasks_for(rng, scene), n_image)
    tasks = list(dict.fromkeys(tasks))  # a task drawn twice is asked once
    n_text = rng.randint(0, min(len(text.truth), MAX_QUESTIONS - len(tasks)))
    kept = rng.sample(list(text.truth), n_text)
    items: list[tuple[str, dict, str, TaskQuestion]] = [
        (qid, text.request["questions"][qid], text.truth[qid], text.tasks[qid]) for qid in kept
    ]
    for task in tasks:
        q, wire, qid = _image_question(rng, task, scene)
        taken = {i[0] for i in items}
        if qid in taken:
            qid = next(f"image_q{k}" for k in range(1, 9) if f"image_q{k}" not in taken)
        items.append((qid, wire, image_truth(scene, q, wire), q))
    rng.shuffle(items)
    request = {
        "id": f"demo-image-{seed}",
        "state": text.request["state"],
        "questions": {qid: wire for qid, wire, _, _ in items},
        "images": [data_url(draw(scene))],
    }
    return ImageExample(
        request,
        {qid: truth for qid, _, truth, _ in items},
        {qid: q for qid, _, _, q in items},
        (scene,),
    )


def family_example(seed: int) -> Example:
    """The image family's request for `seed`: an image request, or (TEXT_ONLY_SHARE of the
    seeds, decided by the seed alone) the text family's own."""
    if random.Random(f"image-mix/{seed}").random() < TEXT_ONLY_SHARE:
        return example(seed)
    return image_example(seed)


def held_out_image_examples(split: int = 0, count: int = 300) -> list[Example]:
    """Held-out split `split` of the image family (the text family's held-out seeds)."""
    return [family_example(s) for s in held_out_seeds(split, count)]


def sample_image_events(n: int, seed: int = 0, *, with_truth: bool = True) -> list[dict[str, Any]]:
    """`n` image requests as events (ids `image-event-<seed>-<i>`), each event's truth in
    its `metadata` as `sample_events` writes it; from the held-out range (never trained)."""
    events = []
    for i, s in enumerate(held_out_seeds(1000 + seed, n)):
        ex = image_example(s)
        event = {**ex.request, "id": f"image-event-{seed}-{i:05d}"}
        if with_truth:
            event["metadata"] = {"truth": dict(ex.truth)}
        events.append(event)
    return events

"""What images cost the worker's host on the CPU: requests of the same text and questions,
with and without inline images, through the worker's own code, side by side in one process.

Variants (the same id pattern, state and two inline questions as bench/worker_overhead.py's
requests; each image a data URL in `images`, the shape vLLM's and openjev's producers send):

- `text only`;
- `1 JPEG`: one photo-like JPEG (quality 85, 4:3) of about `--image-kb` KB (200 by default:
  1024 x 768, about 2 bits a pixel, as a phone photo shrunk for the web);
- `4 JPEG`: four of them, each of about `--multi-kb` KB (190 by default: four of 200 KB do
  not fit the worker's 1 MiB record in base64, docs/images.md, "How large an inline image may
  be on Kafka"; four of 190 KB do);
- `1 PNG`: one screenshot-like PNG (text lines and flat boxes) of about `--image-kb` KB.

Every picture is drawn from `--seed` (numpy's generator, Pillow's encoders): the same bytes
each run. Its size is found by bisecting its width to the target.

Measured per request, for each variant, on the worker's path:

- `parse`: the record's fallback id (`record_id`) and the intake's `InputReader.parse` of the
  value (`schemas.parse_request`: UTF-8, JSON, the models, each data URL's base64 checked);
- `gate`: the engine stage's `InputGate.check` of a batch (`--batch` requests): each inline
  image's base64 decoded, and decoded by Pillow (`workers.images.decode`, on asyncio's
  threads as in the worker), its pixels kept, as for an engine that reads images;
- `front`: the classifier front with the fake engine at zero cost (`Classifier.classify` of
  the batch with the images the gate kept, as `BatchClassifier` calls it). The fake engine
  reads no images, so it is told it does (`EngineInfo.reads_images`) and ignores them:
  the transformers engine's own work on an image (the resize to 32 x 32, the patches, the
  tower) is not in this figure.

Each variant's figure is the median of `--repeat` samples; the samples are interleaved (one
of each variant in turn, the order rotating); a sample runs the variant's `--requests`
requests as often as it takes to last about `--sample-s` seconds. Wall time (the decode
threads run on every core) and the process's CPU time (all its threads) are both reported.
Every request of every sample is checked: parsed, passed by the gate with its images, and
answered by the classifier; anything else fails the run.

    .venv/bin/python -m bench.images_host
    .venv/bin/python -m bench.images_host --repeat 9 --json /tmp/images_host.json

Prints a markdown table and the command; writes nothing unless `--json PATH` is given.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import dataclasses
import io
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image, ImageDraw, ImageFilter

from bench.harness.requests import QUESTIONS
from dgstream.schemas import ClassificationRequest, ClassificationResult, record_id
from dgstream.schemas.images import MAX_IMAGES
from dgstream.workers.engine.classifier import Classifier, ClassifierSettings
from dgstream.workers.engine.factory import EngineSettings, build_engine
from dgstream.workers.engine.types import EngineInfo, Read, ReadImage, ReadResult
from dgstream.workers.hosting.metrics import WorkerMetrics
from dgstream.workers.hosting.settings import WorkerSettings
from dgstream.workers.images import GateOutcome, InputGate
from dgstream.workers.kafka.settings import KafkaConnection
from dgstream.workers.steps.inputs import InputReader

TOPIC = "bench-images"
# The tokens the transformers engine lays for an image (`<boi>`, 64 image tokens, `<eoi>`).
IMAGE_TOKENS = 66


# ---------------------------------------------------------------------------- the pictures


def photo(seed: int, width: int, height: int) -> Image.Image:
    """A photo-like picture: a smooth colour field, a dozen soft discs, sensor-like noise."""
    rng = np.random.default_rng(seed)
    low = rng.integers(0, 256, (6, 8, 3), dtype=np.uint8)
    im = Image.fromarray(low, "RGB").resize((width, height), Image.Resampling.BICUBIC)
    draw = ImageDraw.Draw(im)
    for _ in range(12):
        x, y = int(rng.integers(0, width)), int(rng.integers(0, height))
        r = int(rng.integers(max(1, width // 30), max(2, width // 6)))
        colour = tuple(int(v) for v in rng.integers(0, 256, 3))
        draw.ellipse((x - r, y - r, x + r, y + r), fill=colour)
    im = im.filter(ImageFilter.GaussianBlur(2))
    noisy = np.asarray(im, dtype=np.int16) + rng.normal(0, 8, (height, width, 1)).astype(np.int16)
    return Image.fromarray(np.clip(noisy, 0, 255).astype(np.uint8), "RGB")


def screen(seed: int, width: int, height: int) -> Image.Image:
    """A screenshot-like picture: lines of text in Pillow's bitmap font, a few flat boxes."""
    rng = np.random.default_rng(seed)
    im = Image.new("RGB", (width, height), (246, 246, 248))
    draw = ImageDraw.Draw(im)
    y = 10
    while y < height - 12:
        words = " ".join(
            "".join(chr(97 + int(c)) for c in rng.integers(0, 26, int(rng.integers(2, 9))))
            for _ in range(int(rng.integers(3, 20)))
        )
        colour = tuple(int(v) for v in rng.integers(0, 120, 3))
        draw.text((10 + int(rng.integers(0, 40)), y), words, fill=colour)
        y += 14
        if rng.random() < 0.08 and width > 60:
            x = int(rng.integers(0, width - 40))
            box = (
                x,
                y,
                x + int(rng.integers(20, max(21, width // 3))),
                y + int(rng.integers(10, 60)),
            )
            draw.rectangle(box, fill=tuple(int(v) for v in rng.integers(100, 256, 3)))
    return im


def _encode(kind: str, seed: int, width: int) -> tuple[bytes, tuple[int, int]]:
    height = max(1, width * 3 // 4)
    out = io.BytesIO()
    if kind == "jpeg":
        photo(seed, width, height).save(out, "JPEG", quality=85)
    else:
        screen(seed, width, height).save(out, "PNG")
    return out.getvalue(), (width, height)


def picture(kind: str, seed: int, target_bytes: int) -> tuple[bytes, tuple[int, int]]:
    """A `kind` ("jpeg" or "png") picture from `seed`, its width bisected so that its file is
    as near `target_bytes` as the search finds; the bytes and (width, height)."""
    hi = 64
    while len(_encode(kind, seed, hi)[0]) < target_bytes and hi < 8192:
        hi *= 2
    lo = hi // 2
    best: tuple[bytes, tuple[int, int]] | None = None
    while lo <= hi:
        mid = (lo + hi) // 2
        data, size = _encode(kind, seed, mid)
        if best is None or abs(len(data) - target_bytes) < abs(len(best[0]) - target_bytes):
            best = (data, size)
        if abs(len(data) - target_bytes) <= target_bytes * 0.01:
            break
        if len(data) < target_bytes:
            lo = mid + 1
        else:
            hi = mid - 1
    assert best is not None
    return best


# ---------------------------------------------------------------------------- the requests


@dataclasses.dataclass
class Variant:
    name: str
    images: list[tuple[str, bytes, tuple[int, int]]]  # (media type, bytes, size)
    values: list[bytes] = dataclasses.field(default_factory=list)

    @property
    def pixels(self) -> int:
        return sum(w * h for _, _, (w, h) in self.images)


def data_url(media: str, data: bytes) -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode('ascii')}"


def request_value(i: int, urls: Sequence[str]) -> bytes:
    body: dict[str, Any] = {
        "id": f"r{i}",
        "state": f"message {i}: see you at the game tonight",
        "questions": QUESTIONS,
    }
    if urls:
        body["images"] = list(urls)
    return json.dumps(body).encode()


def variants(args: argparse.Namespace) -> list[Variant]:
    one = args.image_kb * 1000
    multi = args.multi_kb * 1000
    jpeg = picture("jpeg", args.seed, one)
    out = [
        Variant("text only", []),
        Variant("1 JPEG", [("image/jpeg", *jpeg)]),
        Variant(
            f"{args.multi} JPEG",
            [("image/jpeg", *picture("jpeg", args.seed + 1 + k, multi)) for k in range(args.multi)],
        ),
        Variant("1 PNG", [("image/png", *picture("png", args.seed, one))]),
    ]
    for v in out:
        urls = [data_url(media, data) for media, data, _ in v.images]
        v.values = [request_value(i, urls) for i in range(args.requests)]
    return out


# ---------------------------------------------------------------------------- the worker's path


class ImageReadingFake:
    """The fake engine, saying it reads images (it ignores them): the classifier front then
    takes a request with images as it does on the transformers engine."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine
        self._info = dataclasses.replace(engine.info, reads_images=True, image_tokens=IMAGE_TOKENS)

    @property
    def info(self) -> EngineInfo:
        return self._info

    async def read(self, reads: Sequence[Read]) -> list[ReadResult]:
        result: list[ReadResult] = await self._engine.read(reads)
        return result

    async def close(self) -> None:
        await self._engine.close()


class _Quiet:
    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None


@dataclasses.dataclass
class WorkerPath:
    """The worker's intake reader, the engine stage's gate and the classifier front."""

    reader: InputReader
    gate: InputGate
    classifier: Classifier
    loop: asyncio.AbstractEventLoop


def worker_path() -> WorkerPath:
    settings = WorkerSettings(
        pipeline="bench",
        input_topics=[TOPIC],
        output_topic="bench-images-out",
        dead_letter_topic="bench-images-dlq",
        group_id="bench-images",
        kafka=KafkaConnection(bootstrap_servers="127.0.0.1:9"),  # never connected
        engine=EngineSettings(backend="fake"),
        log_level="WARNING",
    )
    engine, chat = build_engine(settings.engine)
    reading = ImageReadingFake(engine)
    classifier = Classifier(reading, chat, ClassifierSettings(seed=settings.engine.seed))
    reader = InputReader(settings, WorkerMetrics("bench", settings.name), _Quiet())
    return WorkerPath(
        reader, InputGate(settings.images, reading.info), classifier, asyncio.new_event_loop()
    )


@dataclasses.dataclass
class Tally:
    """One variant's requests as the path left them (every sample adds its count)."""

    requests: int = 0
    parsed: int = 0
    passed: int = 0  # by the gate, with every image kept
    answered: int = 0


async def _engine_stage(
    path: WorkerPath, requests: list[ClassificationRequest], want: int
) -> tuple[GateOutcome, list[tuple[ReadImage, ...]], list[Any], tuple[float, float]]:
    """What `BatchClassifier` does on the engine loop: the gate, then the classifier with the
    images it kept; and when the gate was done."""
    checked = await path.gate.check(requests)
    done = time.process_time(), time.perf_counter()
    images = [checked.images.get(i, ()) for i in range(len(requests))]
    if want:
        outcomes = await path.classifier.classify(requests, images)
    else:
        outcomes = await path.classifier.classify(requests)
    return checked, images, list(outcomes), done


def one_pass(path: WorkerPath, v: Variant, batch: int, tally: Tally) -> dict[str, float]:
    """The variant's requests through the path once: seconds of parse, gate and front, wall
    and the process's CPU (all its threads: the decoding runs on asyncio's)."""
    took = dict.fromkeys(("parse", "gate", "front", "parse_cpu", "gate_cpu", "front_cpu"), 0.0)
    want = len(v.images)
    for start in range(0, len(v.values), batch):
        c0, t0 = time.process_time(), time.perf_counter()
        requests: list[ClassificationRequest] = []
        for offset, value in enumerate(v.values[start : start + batch], start):
            fallback = record_id(f"k{offset}".encode(), TOPIC, 0, offset)
            got = path.reader.parse(value, fallback, None)
            if isinstance(got, ClassificationRequest):
                requests.append(got)
        c1, t1 = time.process_time(), time.perf_counter()
        stage = _engine_stage(path, requests, want)
        checked, images, outcomes, (c2, t2) = path.loop.run_until_complete(stage)
        c3, t3 = time.process_time(), time.perf_counter()
        for k, wall, cpu in (("parse", t1 - t0, c1 - c0), ("gate", t2 - t1, c2 - c1)):
            took[k] += wall
            took[f"{k}_cpu"] += cpu
        took["front"] += t3 - t2
        took["front_cpu"] += c3 - c2
        tally.requests += min(batch, len(v.values) - start)
        tally.parsed += len(requests)
        tally.passed += sum(
            1 for i in range(len(requests)) if i not in checked.refused and len(images[i]) == want
        )
        tally.answered += sum(isinstance(o, ClassificationResult) for o in outcomes)
    return took


def measure(
    path: WorkerPath, vs: list[Variant], args: argparse.Namespace
) -> tuple[dict[str, dict[str, list[float]]], dict[str, Tally]]:
    """Per variant: µs per request of each sample: parse, gate, front, parse_gate, all (the
    three), wall and (`_cpu`) the process's CPU time."""
    tallies = {v.name: Tally() for v in vs}
    # Warm-up, and how many passes make a sample of about `sample_s` seconds.
    passes: dict[str, int] = {}
    for v in vs:
        one_pass(path, v, args.batch, Tally())
        t0 = time.perf_counter()
        one_pass(path, v, args.batch, Tally())
        took = time.perf_counter() - t0
        passes[v.name] = max(1, round(args.sample_s / max(took, 1e-6)))
    samples: dict[str, dict[str, list[float]]] = {v.name: {} for v in vs}
    for rep in range(args.repeat):
        order = vs[rep % len(vs) :] + vs[: rep % len(vs)]
        for v in order:
            n = passes[v.name] * len(v.values)
            sums: dict[str, float] = {}
            for _ in range(passes[v.name]):
                for k, secs in one_pass(path, v, args.batch, tallies[v.name]).items():
                    sums[k] = sums.get(k, 0.0) + secs
            for cpu in ("", "_cpu"):
                sums[f"parse_gate{cpu}"] = sums[f"parse{cpu}"] + sums[f"gate{cpu}"]
                sums[f"all{cpu}"] = sums[f"parse_gate{cpu}"] + sums[f"front{cpu}"]
            for k, secs in sums.items():
                samples[v.name].setdefault(k, []).append(secs / n * 1e6)
    return samples, tallies


def check(vs: list[Variant], tallies: dict[str, Tally]) -> None:
    for v in vs:
        t = tallies[v.name]
        if not t.requests or not (t.requests == t.parsed == t.passed == t.answered):
            raise RuntimeError(f"{v.name}: {t}")


# ---------------------------------------------------------------------------- the report


def command(argv: Sequence[str]) -> str:
    return " ".join([".venv/bin/python -m bench.images_host", *argv])


def _images(v: Variant) -> str:
    if not v.images:
        return "none"
    kbs = sorted(len(d) / 1000 for _, d, _ in v.images)
    sides = sorted({f"{w} x {h}" for _, _, (w, h) in v.images})
    kb = f"{kbs[0]:.0f}" if len(kbs) == 1 else f"{kbs[0]:.0f}-{kbs[-1]:.0f}"
    return f"{kb} KB, {', '.join(sides)}"


def _times(ratio: float) -> str:
    return f"{ratio:,.1f}x" if ratio < 10 else f"{ratio:,.0f}x"


def table(vs: list[Variant], med: dict[str, dict[str, float]], cpu: str) -> list[str]:
    """One table of medians: wall time (`cpu` "") or the process's CPU time ("_cpu")."""
    base = med[vs[0].name]
    rows = [
        "| variant | images (each) | record | parse µs | image gate µs "
        "| **parse + gate µs/request** | requests/s | vs text only "
        "| + classifier front (fake engine) µs/request | requests/s | vs text only |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for v in vs:
        m = med[v.name]
        pg, whole = m[f"parse_gate{cpu}"], m[f"all{cpu}"]
        rows.append(
            f"| {v.name} | {_images(v)} | {len(v.values[0]) / 1000:,.1f} KB "
            f"| {m[f'parse{cpu}']:,.0f} | {m[f'gate{cpu}']:,.0f} | **{pg:,.0f}** "
            f"| {1e6 / pg:,.0f} | {_times(pg / base[f'parse_gate{cpu}'])} | {whole:,.0f} "
            f"| {1e6 / whole:,.0f} | {_times(whole / base[f'all{cpu}'])} |"
        )
    return rows


def report(
    vs: list[Variant],
    samples: dict[str, dict[str, list[float]]],
    args: argparse.Namespace,
    argv: Sequence[str],
    load: float,
) -> tuple[str, dict[str, Any]]:
    """The markdown (two tables, the conditions, the command) and the figures."""
    med = {name: {k: statistics.median(x) for k, x in s.items()} for name, s in samples.items()}
    figures = {
        v.name: {
            "images": [
                {"media_type": media, "bytes": len(d), "width": w, "height": h}
                for media, d, (w, h) in v.images
            ],
            "record_bytes": len(v.values[0]),
            "median_us": med[v.name],
            "samples_us": samples[v.name],
        }
        for v in vs
    }
    cores = f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()})"
    md = "\n".join(
        [
            "Wall time per request (Pillow decodes on asyncio's threads, as in the worker):",
            "",
            *table(vs, med, ""),
            "",
            "The process's CPU time per request (all its threads):",
            "",
            *table(vs, med, "_cpu"),
            "",
            f"{cores}, Python {platform.python_version()}, Pillow {Image.__version__}; "
            f"{args.requests} requests a variant in batches of {args.batch}, median of "
            f"{args.repeat} interleaved samples of about {args.sample_s:g} s each; load "
            f"average {load:.1f} at the start.",
            "",
            f"Reproduce: `{command(argv)}`",
        ]
    )
    return md, figures


def _without_json(argv: Sequence[str]) -> list[str]:
    """The arguments but `--json PATH` (where the figures go is no part of the command)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--json":
            skip = True
        elif not a.startswith("--json="):
            out.append(a)
    return out


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=64, help="requests a variant (a pass)")
    ap.add_argument("--batch", type=int, default=64, help="requests a gate and front call")
    ap.add_argument("--repeat", type=int, default=7, help="interleaved samples a variant")
    ap.add_argument("--sample-s", type=float, default=0.5, help="about how long a sample runs")
    ap.add_argument("--image-kb", type=int, default=200, help="the single image's size")
    ap.add_argument("--multi", type=int, default=4, help="images in the several-image variant")
    ap.add_argument("--multi-kb", type=int, default=190, help="each of those images' size")
    ap.add_argument("--seed", type=int, default=49)
    ap.add_argument("--json", help="write the figures and counts here")
    return ap


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if not 1 <= args.multi <= MAX_IMAGES:
        raise SystemExit(f"--multi: 1 to {MAX_IMAGES} images a request")
    load = os.getloadavg()[0]
    vs = variants(args)
    path = worker_path()
    try:
        samples, tallies = measure(path, vs, args)
    finally:
        path.loop.close()
    md, figures = report(vs, samples, args, _without_json(argv), load)
    if args.json:
        doc = {
            "command": command(_without_json(argv)),
            "variants": figures,
            "counts": {name: dataclasses.asdict(t) for name, t in tallies.items()},
        }
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    print(md)
    check(vs, tallies)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

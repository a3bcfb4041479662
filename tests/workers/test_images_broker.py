"""On the real broker: a request with a good image and one with a decompression bomb are
dead-lettered (IMAGES_NOT_READ, IMAGE_TOO_LARGE) with their records byte for byte, the text
requests around them are answered, and the worker keeps running."""

from __future__ import annotations

import json

import pytest
from image_files import data_url, png, png_bomb

from bench.harness.pipeline import OutputReader, Pipeline, WorkerThread, request_bytes
from dgstream.schemas import DeadLetter, ErrorCode

pytestmark = pytest.mark.broker


def _image_request(rid: str, image: bytes) -> bytes:
    body = {
        "id": rid,
        "state": "a picture someone posted",
        "questions": {"toxic": {"type": "yes_no", "instructions": "Is it toxic?"}},
        "images": [data_url(image)],
    }
    return json.dumps(body).encode()


def test_image_requests_are_dead_lettered_and_the_rest_answered(
    pipeline: Pipeline, worker_threads: list[WorkerThread]
) -> None:
    sent = [
        request_bytes("t0", 0),
        _image_request("img", png((32, 32), "blue")),
        _image_request("bomb", png_bomb(100_000, 100_000)),
        request_bytes("t1", 2),
    ]
    keys = [b"t0", b"img", b"bomb", b"t1"]
    pipeline.produce(sent, keys=keys, partition=0)
    worker = WorkerThread(pipeline.settings()).start()
    worker_threads.append(worker)

    dead = OutputReader(pipeline.conn, pipeline.dead)
    results = OutputReader(pipeline.conn, pipeline.output)
    pipeline.readers += [dead, results]
    dead.read_until(lambda r: len(r.records) >= 2, 90, "2 dead letters")
    results.read_until(lambda r: len(r.records) >= 2, 90, "2 results")

    letters = {r.key: DeadLetter.from_record(r.value, r.key, r.headers) for r in dead.records}
    assert letters[b"img"].error.code is ErrorCode.IMAGES_NOT_READ
    assert letters[b"bomb"].error.code is ErrorCode.IMAGE_TOO_LARGE
    assert letters[b"bomb"].error.field == "images.0"
    assert letters[b"img"].original_value() == sent[1]
    assert letters[b"bomb"].original_value() == sent[2]
    assert sorted(results.ids()) == ["t0", "t1"]
    assert worker.error is None and worker.worker.state == "running"

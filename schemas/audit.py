"""What decided a result, written into it (`ClassificationResult.audit`).

An auditor asks of one blocked message: which model (and which exact weights), which prompt,
which questions, which engine settings, which rule sent it where, and who answered. Every
field here answers one of those, and every hash is over a canonical JSON text (sorted keys,
no spaces) so that two workers given the same inputs write the same value:

- `checkpoint`: the model's revision when it has one (a Hugging Face commit, or one the
  pipeline declares), else `sha256:` of the checkpoint's files;
- `prompt_template`: the version of the prompt and canvas layout the worker writes (bumped
  whenever a change to them could move an answer; a test pins it to the rendered text);
- `questions_hash`: the questions asked (their definitions, as the worker read them);
- `engine`: the engine settings that can change an answer, and `engine_hash` over them;
- `route`, `route_rule`, `routes_hash`: the route that matched (its name and condition) and
  a hash of the pipeline's whole route list; `route_acted` is false in a shadow deployment,
  which records the route but sends every result to its own topic;
- `calibration`: the hash of the calibration file applied before the routes, or null;
- `images` (only in the results of requests that carry images): each image the engine read,
  in request order, by the SHA-256 of its bytes and where they came from (`AuditImage`).

`digest` is the one hash function all of these use.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import Field

from dgstream.schemas._common import WireModel

__all__ = ["Audit", "AuditImage", "canonical_json", "digest"]

# 128 bits of SHA-256: far beyond any collision an audit trail could meet, at half the text.
_DIGEST_HEX = 32

EngineValue = str | int | float | bool | None


def canonical_json(value: Any) -> str:
    """The JSON text every hash here is taken over: sorted keys, no spaces, UTF-8 as is."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def digest(value: Any) -> str:
    """`sha256:` and the first 32 hex digits of SHA-256 over `canonical_json(value)` (bytes
    are hashed as they are)."""
    data = value if isinstance(value, bytes) else canonical_json(value).encode("utf-8")
    return "sha256:" + hashlib.sha256(data).hexdigest()[:_DIGEST_HEX]


class AuditImage(WireModel):
    """One image a result was read from: what its bytes were and where they came from."""

    field: str = Field(
        description='The request field that held it: "images.0", "input.1.image_url.url", '
        '"assets.<placeholder>".'
    )
    sha256: str = Field(description="SHA-256 (hex) of the image's bytes as received.")
    source: Literal["inline", "url"] = Field(
        description='"inline": the bytes were in the record (a data URL, a Jev asset); '
        '"url": fetched by the worker.'
    )
    url: str | None = Field(
        description="Where a fetched image's bytes came from (after redirects), without "
        "user info, query or fragment (a pre-signed URL's token lives there); null inline."
    )


class Audit(WireModel):
    """What decided this result: model, prompt, questions, engine, route, calibration, worker."""

    model: str = Field(description="The engine's model (a name or a path).")
    checkpoint: str = Field(
        description="The checkpoint's revision (a Hugging Face commit, or the pipeline's "
        "`engine.revision`), else `sha256:` of its files."
    )
    checkpoint_source: Literal["revision", "content_hash", "declared"] = Field(
        description='"revision": read from the model\'s hub snapshot; "content_hash": hashed '
        'from its files; "declared": the pipeline\'s `engine.revision`.'
    )
    prompt_template: str = Field(description="Version of the prompt and canvas layout.")
    question_set: str | None = Field(
        description="The question set the request named, or null for inline questions."
    )
    questions_hash: str = Field(description="Hash of the questions' definitions, as asked.")
    engine: dict[str, EngineValue] = Field(
        description="The engine settings that can change an answer (backend, dtype, seed, "
        "canvas, read policy, ...)."
    )
    engine_hash: str = Field(description="Hash of `engine`.")
    route: str = Field(
        description='The route that matched: a route\'s name, "default" (none did) or '
        '"reply" (the request\'s reply_topic).'
    )
    route_rule: str | None = Field(
        description="The matched route's condition (`when`); null for default and reply."
    )
    routes_hash: str = Field(
        description="Hash of the pipeline's routes (names, conditions, topics)."
    )
    route_acted: bool = Field(
        description="Whether the route chose where the result went (false in shadow mode)."
    )
    calibration: str | None = Field(
        description="Hash of the calibration file applied before the routes; null for none."
    )
    pipeline: str
    deployment: str
    worker: str
    dgstream_version: str
    # Absent (not null) in a text-only request's result: those bytes stay what they were
    # before images were read.
    images: list[AuditImage] | None = Field(
        default=None,
        exclude_if=lambda v: v is None,
        description="The images the engine read with the text, in request order; absent "
        "from the results of requests without images.",
    )

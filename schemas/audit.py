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
- `calibration`: the hash of the calibration file applied before the routes, or null.

`digest` is the one hash function all of these use.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any, Literal

from pydantic import Field

from schemas._common import WireModel

__all__ = ["Audit", "canonical_json", "digest"]

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

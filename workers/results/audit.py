"""The audit block of a pipeline's results (`schemas.Audit`): what decided each one.

`Auditor` is built once per worker: the checkpoint's revision or content hash
(`checkpoint_of`, read or hashed once at start), the engine settings that can change an
answer, the hash of the routes and of the calibration file. Per result it adds the
question set's name and the hash of the questions asked (cached per question set) and the
route that matched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from importlib import metadata
from typing import Any

from dgstream.schemas import Audit, AuditImage, ClassificationRequest, digest
from dgstream.schemas.audit import canonical_json
from dgstream.workers.engine.backends import get_backend
from dgstream.workers.engine.backends._base import content_hash
from dgstream.workers.engine.factory import EngineSettings
from dgstream.workers.engine.template import PROMPT_TEMPLATE_VERSION

__all__ = ["Auditor", "checkpoint_of", "content_hash", "engine_fields", "routes_hash"]

# The audits kept for reuse (question set or questions, route): a worker sees few.
_KEPT = 1024


def _version() -> str:
    try:
        return metadata.version("dgstream")
    except metadata.PackageNotFoundError:
        return "unknown"


def checkpoint_of(engine: EngineSettings) -> tuple[str, str]:
    """(the checkpoint's revision or content hash, where it came from) for an engine: the
    revision the pipeline declares, else what its backend finds (`Backend.checkpoint`)."""
    if engine.revision is not None:
        return engine.revision, "declared"
    return get_backend(engine.backend).checkpoint(engine)


def engine_fields(
    engine: EngineSettings, canvas_length: int, auto: tuple[float, int]
) -> dict[str, Any]:
    """The engine settings that can change an answer (not those that only change speed:
    batch sizes, prefix reuse, memory, timeouts): those every backend shares, then the
    backend's own (`Backend.audit_fields`)."""
    out: dict[str, Any] = {
        "backend": engine.backend,
        "seed": engine.seed,
        "canvas_length": canvas_length,
        "auto_threshold": auto[0],
        "auto_max": auto[1],
    }
    out.update(get_backend(engine.backend).audit_fields(engine))
    return out


def routes_hash(routes: Sequence[Any]) -> str:
    """The hash of a pipeline's routes, in order (name, condition, topic)."""
    return digest([{"name": r.name, "when": r.when, "topic": r.topic} for r in routes])


class Auditor:
    """Builds each result's `Audit` (engine loop)."""

    def __init__(
        self,
        *,
        pipeline: str,
        deployment: str,
        worker: str,
        engine: EngineSettings,
        model: str,
        checkpoint: tuple[str, str],
        canvas_length: int,
        auto: tuple[float, int],
        routes: Sequence[Any],
        question_sets: Mapping[str, Mapping[str, Any]],
        calibration: str | None,
        shadow: bool = False,
    ) -> None:
        fields = engine_fields(engine, canvas_length, auto)
        self._rules = {r.name: r.when for r in routes}
        self._acted = not shadow
        self._base: dict[str, Any] = {
            "model": model,
            "checkpoint": checkpoint[0],
            "checkpoint_source": checkpoint[1],
            "prompt_template": PROMPT_TEMPLATE_VERSION,
            "engine": fields,
            "engine_hash": digest(fields),
            "routes_hash": routes_hash(routes),
            "calibration": calibration,
            "pipeline": pipeline,
            "deployment": deployment,
            "worker": worker,
            "dgstream_version": _version(),
        }
        self._set_hashes = {name: _questions_hash(qs) for name, qs in question_sets.items()}
        self._made: dict[tuple[str | None, str, str], Audit] = {}

    def audit(
        self, request: ClassificationRequest, route: str, images: Sequence[AuditImage] = ()
    ) -> Audit:
        """The audit of `request`'s result, sent by `route` (a route's name, "default" or
        "reply"); `images`: those it was read with, in request order (none: text only)."""
        made = self._shared(request, route)
        # Images differ from request to request: added to a copy, never to the kept audit.
        return made.model_copy(update={"images": list(images)}) if images else made

    def _shared(self, request: ClassificationRequest, route: str) -> Audit:
        name = request.question_set
        if name is not None and name in self._set_hashes:
            qhash = self._set_hashes[name]
        else:
            qhash = _questions_hash(request.questions or {})
        # An audit is frozen and depends on these three alone: one per combination, kept
        # (bounded), instead of one pydantic model built per result. A field that differs
        # from request to request beyond these must join the key, or be set on the copy.
        key = (name, qhash, route)
        made = self._made.get(key)
        if made is not None:
            return made
        if len(self._made) >= _KEPT:
            self._made.clear()
        # Every field is built here from validated settings: no second validation per result.
        made = self._made[key] = Audit.model_construct(
            **self._base,
            question_set=name,
            questions_hash=qhash,
            route=route,
            route_rule=self._rules.get(route),
            route_acted=self._acted,
        )
        return made


def _questions_hash(questions: Mapping[str, Any]) -> str:
    """`sha256:` over each question's id and its definition as pydantic writes it (fields in
    their declared order: the same questions give the same text), in request order. Not
    `digest`: this runs for every request with inline questions, and pydantic's own JSON is
    several times faster than a sorted `json.dumps` of a dump."""
    h = hashlib.sha256()
    for qid, q in questions.items():
        text = q.model_dump_json() if hasattr(q, "model_dump_json") else canonical_json(q)
        h.update(f"{qid}\0{text}\0".encode())
    return "sha256:" + h.hexdigest()[:32]

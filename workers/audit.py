"""The audit block of a pipeline's results (`schemas.Audit`): what decided each one.

`Auditor` is built once per worker: the checkpoint's revision or content hash
(`checkpoint_of`, read or hashed once at start), the engine settings that can change an
answer, the hash of the routes and of the calibration file. Per result it adds the
question set's name and the hash of the questions asked (cached per question set) and the
route that matched.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from importlib import metadata
from pathlib import Path
from typing import Any

from schemas import Audit, ClassificationRequest, digest
from schemas.audit import canonical_json
from workers.engine.factory import EngineSettings
from workers.engine.template import PROMPT_TEMPLATE_VERSION

__all__ = ["Auditor", "checkpoint_of", "content_hash", "engine_fields", "routes_hash"]

# A Hugging Face hub snapshot directory: .../snapshots/<40-hex commit>/...
_SNAPSHOT = re.compile(r"(?:^|/)snapshots/([0-9a-f]{40})(?:/|$)")
_CHUNK = 1 << 20  # hashing reads 1 MiB at a time


def _version() -> str:
    try:
        return metadata.version("dgstream")
    except metadata.PackageNotFoundError:
        return "unknown"


def content_hash(directory: Path) -> str:
    """`sha256:` over every file of a checkpoint directory (sorted relative paths and their
    bytes; hidden entries skipped): the same weights, tokenizer and chat template give the
    same hash wherever they lie."""
    h = hashlib.sha256()
    root = directory.resolve()
    files = sorted(
        p
        for p in root.rglob("*")
        if p.is_file() and not any(part.startswith(".") for part in p.relative_to(root).parts)
    )
    for path in files:
        h.update(str(path.relative_to(root)).encode() + b"\0")
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                h.update(chunk)
        h.update(b"\0")
    return "sha256:" + h.hexdigest()[:32]


def _hub_snapshot(model: str, revision: str | None) -> Path | None:
    """The local snapshot of a hub model id, when the hub's cache holds one (no download)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=revision, local_files_only=True))
    except Exception:
        return None


def _directory_checkpoint(path: Path) -> tuple[str, str]:
    m = _SNAPSHOT.search(path.resolve().as_posix() + "/")
    if m is not None:
        return m.group(1), "revision"
    return content_hash(path), "content_hash"


def checkpoint_of(engine: EngineSettings) -> tuple[str, str]:
    """(the checkpoint's revision or content hash, where it came from) for an engine."""
    if engine.revision is not None:
        return engine.revision, "declared"
    if engine.backend in ("transformers", "fake"):
        from workers.engine.factory import model_dir

        # The fake engine reads no weights; its tokenizer is the tiny model's.
        return _directory_checkpoint(
            model_dir(engine.model if engine.backend != "fake" else "tiny-random")
        )
    model = engine.vllm.model if engine.backend == "vllm" else engine.remote.model
    revision = engine.vllm.revision if engine.backend == "vllm" else None
    local = Path(model).expanduser()
    if engine.backend == "vllm" and (local / "config.json").exists():
        return _directory_checkpoint(local)
    if revision is not None:
        return revision, "revision"
    snapshot = _hub_snapshot(model, None)
    if snapshot is not None:
        return _directory_checkpoint(snapshot)
    # A remote server's weights cannot be read from here: its model's name is all there is.
    return model, "name"


def engine_fields(
    engine: EngineSettings, canvas_length: int, auto: tuple[float, int]
) -> dict[str, Any]:
    """The engine settings that can change an answer (not those that only change speed:
    batch sizes, prefix reuse, memory, timeouts)."""
    out: dict[str, Any] = {
        "backend": engine.backend,
        "seed": engine.seed,
        "canvas_length": canvas_length,
        "auto_threshold": auto[0],
        "auto_max": auto[1],
    }
    if engine.backend == "transformers":
        out.update(model=engine.model, dtype=engine.dtype, device=engine.device)
    elif engine.backend == "vllm":
        v = engine.vllm
        out.update(
            model=v.model,
            dtype=v.dtype,
            quantization=v.quantization,
            load_format=v.load_format,
            diffusion_constrained=v.diffusion_constrained,
            tensor_parallel_size=v.tensor_parallel_size,
        )
    elif engine.backend == "vllm-remote":
        r = engine.remote
        out.update(model=r.model, diffusion_constrained=r.diffusion_constrained)
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

    def audit(self, request: ClassificationRequest, route: str) -> Audit:
        """The audit of `request`'s result, sent by `route` (a route's name, "default" or
        "reply")."""
        name = request.question_set
        if name is not None and name in self._set_hashes:
            qhash = self._set_hashes[name]
        else:
            qhash = _questions_hash(request.questions or {})
        # Every field is built here from validated settings: no second validation per result.
        return Audit.model_construct(
            **self._base,
            question_set=name,
            questions_hash=qhash,
            route=route,
            route_rule=self._rules.get(route),
            route_acted=self._acted,
        )


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

"""What an engine backend is: the base class every backend module subclasses.

A backend is one module of `workers/engine/backends/` holding one `Backend` subclass,
decorated with `workers.engine.backends.register`. It owns:

- `name`: what `engine.backend:` says in the topology file (and `EngineInfo.backend`);
- `settings` and `settings_key`: its own settings model and the key under `engine:` that
  holds them (None: the backend reads only the engine's common fields, `model`, `device`,
  `dtype` and the like, and its `settings` is `NoSettings`);
- `gpus`: the GPUs a replica asks Ray for when the pipeline does not say
  (`resources.gpus`);
- `build`: the engine and the chat format of its model;
- `audit_fields`: its settings that can change an answer (the results' `audit.engine`,
  beside the fields every backend shares);
- `checkpoint`: the checkpoint's revision or content hash, and where it came from, when the
  pipeline declares no `engine.revision`.

The helpers a backend needs for those (the model directory of a name, the chat format, the
checkpoint's hash) are here too, so a backend imports nothing of the factory.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Generic, TypeVar, cast

from pydantic import BaseModel, ConfigDict

if TYPE_CHECKING:  # the factory builds its settings from the registry
    from dgstream.workers.engine.factory import EngineSettings
    from dgstream.workers.engine.template import ChatFormat
    from dgstream.workers.engine.types import Engine

__all__ = [
    "Backend",
    "NoSettings",
    "chat_for",
    "content_hash",
    "directory_checkpoint",
    "hub_checkpoint",
    "model_dir",
    "shared_labels",
]


class NoSettings(BaseModel):
    """The settings of a backend that has no key of its own: every backend has a settings
    model, so callers never special-case one without."""

    model_config = ConfigDict(frozen=True, extra="forbid")


S = TypeVar("S", bound=BaseModel)


class Backend(Generic[S]):
    """One engine backend (see the module's docstring for what a subclass sets)."""

    name: ClassVar[str]
    settings: type[S]
    settings_key: ClassVar[str | None] = None
    gpus: ClassVar[float] = 0.0

    def own(self, engine: EngineSettings) -> S:
        """This backend's settings in `engine` (their defaults when it has no key)."""
        if self.settings_key is None:
            return self.settings()
        return cast(S, getattr(engine, self.settings_key))

    def build(self, engine: EngineSettings) -> tuple[Engine, ChatFormat]:
        """The engine and the chat format of its model (tokenizer, special ids)."""
        raise NotImplementedError

    def audit_fields(self, engine: EngineSettings) -> dict[str, Any]:
        """The settings of this backend that can change an answer (not those that only
        change speed: batch sizes, prefix reuse, memory, timeouts)."""
        return {}

    def checkpoint(self, engine: EngineSettings) -> tuple[str, str]:
        """(the checkpoint's revision or content hash, where it came from)."""
        raise NotImplementedError


# --------------------------------------------------------------------- models and chat


def model_dir(name: str) -> Path:
    """The directory a transformers model name stands for (built-in, or a path)."""
    from dgstream.workers.engine import models

    if name in models.SPECS:
        return models.ensure_tiny_model(name)
    path = Path(name).expanduser()
    if not (path / "config.json").exists():
        known = ", ".join(sorted(models.SPECS))
        raise ValueError(
            f"engine.model: {name!r} is neither a built-in model ({known}) nor a "
            f"directory holding a config.json"
        )
    return path


def chat_for(path_or_name: str | Path) -> ChatFormat:
    from transformers import AutoTokenizer

    from dgstream.workers.engine.template import ChatFormat

    return ChatFormat(AutoTokenizer.from_pretrained(str(path_or_name)))


def shared_labels(chat: ChatFormat) -> tuple[int, ...]:
    """The token ids of every label the templates write (an engine's shared label set)."""
    from dgstream.workers.engine.template import standard_label_ids

    return standard_label_ids(chat.encode)


# --------------------------------------------------------------------- checkpoints

# A Hugging Face hub snapshot directory: .../snapshots/<40-hex commit>/...
_SNAPSHOT = re.compile(r"(?:^|/)snapshots/([0-9a-f]{40})(?:/|$)")
_CHUNK = 1 << 20  # hashing reads 1 MiB at a time


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


def directory_checkpoint(path: Path) -> tuple[str, str]:
    """A checkpoint directory's hub revision (a snapshot's commit), else its content hash."""
    m = _SNAPSHOT.search(path.resolve().as_posix() + "/")
    if m is not None:
        return m.group(1), "revision"
    return content_hash(path), "content_hash"


def _hub_snapshot(model: str) -> Path | None:
    """The local snapshot of a hub model id, when the hub's cache holds one (no download)."""
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, revision=None, local_files_only=True))
    except Exception:
        return None


def hub_checkpoint(model: str, revision: str | None = None) -> tuple[str, str]:
    """A model named by id: the revision given, else its local hub snapshot's, else its
    name (a remote server's weights cannot be read from here: the name is all there is)."""
    if revision is not None:
        return revision, "revision"
    snapshot = _hub_snapshot(model)
    if snapshot is not None:
        return directory_checkpoint(snapshot)
    return model, "name"

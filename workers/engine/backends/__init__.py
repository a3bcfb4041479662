"""The engine backends a worker can run, one module each, found by name.

Every module of this package not named with a leading underscore is imported here and
registers its `Backend` subclass (`_base.py` says what one owns: its build, its settings
and their key under `engine:`, its audit fields, its checkpoint and its GPUs by default).
The registry is the only list of backends: the topology file's `engine.backend`, the
engine's settings keys (`workers.engine.factory.EngineSettings`), `build_engine`, the
results' audit (`workers.results.audit`), a replica's GPUs (`WorkerSettings.num_gpus`) and the
"Engine backends" table of docs/configuration.md all read it.

Adding a backend: a module here with a `@register`ed `Backend` subclass, and its tests; its
row in docs/configuration.md is generated (`python -m dgstream.topology.docs`).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from dgstream.schemas.registry import Registry
from dgstream.workers.engine.backends._base import Backend, NoSettings

__all__ = [
    "Backend",
    "NoSettings",
    "backend_names",
    "backends",
    "get_backend",
    "register",
    "unregister",
]

_REGISTRY: Registry[Backend[Any]] = Registry(
    "engine backend",
    key_attr="settings_key",
    key_kind="settings key",
    home="workers/engine/backends/",
)
register = _REGISTRY.register
unregister = _REGISTRY.unregister
get_backend = _REGISTRY.get
backend_names = _REGISTRY.names


def backends() -> tuple[Backend[Any], ...]:
    return tuple(_REGISTRY)


def settings_fields() -> dict[str, Any]:
    """The engine settings' fields of the backends' own settings, by key (for
    `create_model`); the keys are fixed from then on."""
    from pydantic import Field

    fields: dict[str, Any] = {}
    for key, backend in _REGISTRY.keyed():
        doc = f"`backend: {backend.name}`'s settings."
        described = Field(default_factory=backend.settings, description=doc)
        fields[key] = (backend.settings, described)
    return fields


# Every backend module of this package, in a fixed order (the registry's order): the
# default backend first, then by name.
_FIRST = ("transformers", "vllm", "vllm_remote", "fake")
for _module in sorted(
    (m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")),
    key=lambda n: (_FIRST.index(n) if n in _FIRST else len(_FIRST), n),
):
    importlib.import_module(f"{__name__}.{_module}")

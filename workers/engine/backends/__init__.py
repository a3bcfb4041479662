"""The engine backends a worker can run, one module each, found by name.

Every module of this package not named with a leading underscore is imported here and
registers its `Backend` subclass (`_base.py` says what one owns: its build, its settings
and their key under `engine:`, its audit fields, its checkpoint and its GPUs by default).
The registry is the only list of backends: the topology file's `engine.backend`, the
engine's settings keys (`workers.engine.factory.EngineSettings`), `build_engine`, the
results' audit (`workers.audit`), a replica's GPUs (`WorkerSettings.num_gpus`) and the
"Engine backends" table of docs/configuration.md all read it.

Adding a backend: a module here with a `@register`ed `Backend` subclass, and its tests; its
row in docs/configuration.md is generated (`python -m topology.docs`).
"""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any, TypeVar

from workers.engine.backends._base import Backend, NoSettings

__all__ = [
    "Backend",
    "NoSettings",
    "backend_names",
    "backends",
    "get_backend",
    "register",
    "unregister",
]

_BACKENDS: dict[str, Backend[Any]] = {}
# Set once the engine's settings model exists: its settings keys are fixed from then on.
_settings_built = False

B = TypeVar("B", bound=type[Backend[Any]])


def register(cls: B) -> B:
    """Class decorator: adds one instance of `cls` to the registry under `cls.name`."""
    backend = cls()
    if backend.name in _BACKENDS:
        raise ValueError(f"engine backend {backend.name!r} is registered twice")
    if backend.settings_key is not None:
        if _settings_built:
            # The engine's settings model is built from the registry once; a key added
            # later would be refused by it, so say it here rather than when a topology is read.
            raise ValueError(
                f"engine backend {backend.name!r}: a backend with a settings key is a module "
                "of workers/engine/backends/ (registered before the settings are built)"
            )
        taken = {b.settings_key for b in _BACKENDS.values()}
        if backend.settings_key in taken:
            raise ValueError(
                f"engine backend {backend.name!r}: settings key {backend.settings_key!r} taken"
            )
    _BACKENDS[backend.name] = backend
    return cls


def unregister(name: str) -> None:
    """Remove a backend (tests register toy ones and remove them again)."""
    backend = _BACKENDS[name]
    if backend.settings_key is not None:
        raise ValueError(f"engine backend {name!r} has settings of its own and stays registered")
    del _BACKENDS[name]


def get_backend(name: str) -> Backend[Any]:
    """The backend named `name`; ValueError naming the registered ones otherwise."""
    try:
        return _BACKENDS[name]
    except KeyError:
        raise ValueError(
            f"unknown engine backend {name!r}; expected one of {backend_names()}"
        ) from None


def backend_names() -> tuple[str, ...]:
    return tuple(_BACKENDS)


def backends() -> tuple[Backend[Any], ...]:
    return tuple(_BACKENDS.values())


def settings_fields() -> dict[str, Any]:
    """The engine settings' fields of the backends' own settings, by key (for
    `create_model`); the keys are fixed from then on."""
    from pydantic import Field

    global _settings_built
    fields: dict[str, Any] = {}
    for backend in backends():
        if backend.settings_key is None:
            continue
        doc = f"`backend: {backend.name}`'s settings."
        described = Field(default_factory=backend.settings, description=doc)
        fields[backend.settings_key] = (backend.settings, described)
    _settings_built = True
    return fields


# Every backend module of this package, in a fixed order (the registry's order): the
# default backend first, then by name.
_FIRST = ("transformers", "vllm", "vllm_remote", "fake")
for _module in sorted(
    (m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")),
    key=lambda n: (_FIRST.index(n) if n in _FIRST else len(_FIRST), n),
):
    importlib.import_module(f"{__name__}.{_module}")

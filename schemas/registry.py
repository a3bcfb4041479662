"""One registry of named plugins, each module registering its class, shared by the output
formats (`schemas.formats`), the engine backends (`workers.engine.backends`) and the
question kinds (`schemas.kinds`).

A plugin may carry a key under which the pipeline's models hold its own settings (a format's
options, a backend's settings). Those models are built from the registry once, so a keyed
plugin registered after that would be refused by them: the registry says so when it is
registered, not when a topology is read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Generic, TypeVar

P = TypeVar("P")
C = TypeVar("C", bound=type[Any])

__all__ = ["Registry"]


class Registry(Generic[P]):
    """Plugins of one kind by name. `kind` names them in errors ("output format");
    `key_attr` is the attribute holding a plugin's settings key (None: plugins of this
    kind have no key, as question kinds);
    `key_kind` names that key ("options key"); `home` is the package whose modules
    register the keyed ones; `reserved` returns keys taken by other fields."""

    def __init__(
        self,
        kind: str,
        key_attr: str | None,
        key_kind: str,
        home: str,
        reserved: Callable[[], set[str]] = set,
    ) -> None:
        self.kind = kind
        self.key_attr = key_attr
        self.key_kind = key_kind
        self.home = home
        self.reserved = reserved
        self._plugins: dict[str, P] = {}
        self._keys_fixed = False

    def key(self, plugin: P) -> str | None:
        if self.key_attr is None:
            return None
        value: str | None = getattr(plugin, self.key_attr)
        return value

    def register(self, cls: C) -> C:
        """Class decorator: adds one instance of `cls` under `cls.name`."""
        plugin = cls()
        name = plugin.name
        if name in self._plugins:
            raise ValueError(f"{self.kind} {name!r} is registered twice")
        key = self.key(plugin)
        if key is not None:
            if self._keys_fixed:
                raise ValueError(
                    f"{self.kind} {name!r}: one with a {self.key_kind} is a module of "
                    f"{self.home} (registered before the pipeline's models are built)"
                )
            taken = {self.key(p) for p in self._plugins.values()} | self.reserved()
            if key in taken:
                raise ValueError(f"{self.kind} {name!r}: {self.key_kind} {key!r} is taken")
        self._plugins[name] = plugin
        return cls

    def unregister(self, name: str) -> None:
        """Remove a plugin (tests register toy ones and remove them again); one with a key
        stays, as the models built from the registry hold its field."""
        if self.key(self._plugins[name]) is not None:
            raise ValueError(f"{self.kind} {name!r} has a {self.key_kind} and stays registered")
        del self._plugins[name]

    def get(self, name: str) -> P:
        """The plugin named `name`; ValueError naming the registered ones otherwise."""
        try:
            return self._plugins[name]
        except KeyError:
            raise ValueError(
                f"unknown {self.kind} {name!r}; expected one of {self.names()}"
            ) from None

    def names(self) -> tuple[str, ...]:
        return tuple(self._plugins)

    def __iter__(self) -> Iterator[P]:
        return iter(tuple(self._plugins.values()))

    def keyed(self) -> Iterator[tuple[str, P]]:
        """(key, plugin) of every plugin with a key; the keys are fixed from then on."""
        self._keys_fixed = True
        for plugin in tuple(self._plugins.values()):
            key = self.key(plugin)
            if key is not None:
                yield key, plugin

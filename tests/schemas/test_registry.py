"""The registry both plugin kinds share (output formats, engine backends): names, keys,
and the refusals a plugin author meets."""

from __future__ import annotations

import pytest

from dgstream.schemas.registry import Registry

pytestmark = pytest.mark.unit


def _registry() -> Registry[object]:
    return Registry(
        "widget", key_attr="key", key_kind="widget key", home="pkg/", reserved=lambda: {"name"}
    )


def _plugin(name: str, key: str | None) -> type:
    """A plugin class as a module would declare one: its name and key as class attributes."""
    return type("Plugin", (), {"name": name, "key": key})


def test_plugins_are_found_by_name_in_registration_order() -> None:
    reg = _registry()
    reg.register(_plugin("b", None))
    reg.register(_plugin("a", "opts"))
    assert reg.names() == ("b", "a")
    assert [p.name for p in reg] == ["b", "a"]  # type: ignore[attr-defined]
    assert reg.get("a").key == "opts"  # type: ignore[attr-defined]
    with pytest.raises(ValueError, match=r"unknown widget 'c'; expected one of \('b', 'a'\)"):
        reg.get("c")


def test_refusals() -> None:
    reg = _registry()
    reg.register(_plugin("a", "opts"))
    with pytest.raises(ValueError, match="registered twice"):
        reg.register(_plugin("a", None))
    with pytest.raises(ValueError, match="widget key 'opts' is taken"):
        reg.register(_plugin("b", "opts"))
    with pytest.raises(ValueError, match="widget key 'name' is taken"):
        reg.register(_plugin("c", "name"))  # a field the models hold already
    with pytest.raises(ValueError, match="has a widget key and stays registered"):
        reg.unregister("a")
    reg.register(_plugin("toy", None))
    reg.unregister("toy")
    assert reg.names() == ("a",)


def test_keys_are_fixed_once_the_models_are_built() -> None:
    reg = _registry()
    reg.register(_plugin("a", "opts"))
    assert [k for k, _ in reg.keyed()] == ["opts"]
    reg.register(_plugin("plain", None))  # no key: still fine
    with pytest.raises(ValueError, match="is a module of pkg/"):
        reg.register(_plugin("late", "late_opts"))

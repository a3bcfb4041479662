"""The question kinds a request may ask, one module each, found by name.

Every module of this package not named with a leading underscore is imported here and
registers its `Kind` subclass (`_base.py` says what one owns: its question, answer and Jev
models, its labels and prompt lines, its answer builder, its route fields and its
calibration). The registry is the only list of kinds: the request's and the result's
discriminated unions (`schemas.Question`, `schemas.Answer`, Jev's answers), the parser's
error codes, the engine's template and answers, the routes' fields, calibration, the
commands' answer lines and the "Question kinds" table of docs/configuration.md all read it.

Adding a kind: a module here with a `@register`ed `Kind` subclass, and its tests; its row in
docs/configuration.md is generated (`python -m dgstream.topology.docs`). A kind registered later (a
test's) is in the unions too: registering one rebuilds the models that hold them
(`holds_kinds`).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, ClassVar, TypeVar, Union

from pydantic import BaseModel, Field, GetCoreSchemaHandler
from pydantic_core import CoreSchema

from dgstream.schemas.kinds._base import (
    Aggregated,
    Answered,
    Kind,
    Probability,
    QuestionBase,
    RouteField,
    clean,
)
from dgstream.schemas.registry import Registry

__all__ = [
    "Aggregated",
    "Answered",
    "Kind",
    "KindUnion",
    "Probability",
    "QuestionBase",
    "RouteField",
    "clean",
    "get_kind",
    "holds_kinds",
    "kind_names",
    "kind_of_type",
    "kinds",
    "name_of",
    "question_types",
    "register",
    "unregister",
]

_REGISTRY: Registry[Kind] = Registry(
    "question kind", key_attr=None, key_kind="", home="schemas/kinds/"
)
get_kind = _REGISTRY.get
kind_names = _REGISTRY.names

M = TypeVar("M", bound=type[BaseModel])
K = TypeVar("K", bound=type[Kind])

# The models whose fields hold a union of the kinds' models, rebuilt when a kind comes or
# goes (their subclasses with them).
_HOLDERS: list[type[BaseModel]] = []


def kinds() -> tuple[Kind, ...]:
    return tuple(_REGISTRY)


def question_types() -> tuple[str, ...]:
    """Every question `type` the wire takes, kind by kind ("noul", "yes_no", "choice", ...)."""
    return tuple(t for k in _REGISTRY for t in k.types)


def kind_of_type(tag: object) -> Kind | None:
    """The kind a `type` tag names: a question's, an answer's (the kind's name) or a Jev
    answer's; None for any other (a skipped answer's, a value that is no tag)."""
    for kind in _REGISTRY:
        if tag == kind.name or tag in kind.types or tag == kind.jev_type:
            return kind
    return None


def name_of(answer: Any) -> str | None:
    """The name of the answer given (yes/no, an option, a level, ...), from an answer or its
    written JSON in our shape; None for a skipped one."""
    written = isinstance(answer, Mapping)
    tag = answer.get("type") if written else getattr(answer, "type", None)
    if tag not in _REGISTRY.names():
        return None
    kind = _REGISTRY.get(tag)
    # Read, not checked: what was written was checked when it was.
    model = kind.answer.model_construct(**answer) if written else answer
    return kind.answer_name(model)


def _family(model: type[BaseModel]) -> Iterator[type[BaseModel]]:
    yield model
    for sub in model.__subclasses__():
        yield from _family(sub)


def _rebuild() -> None:
    for holder in _HOLDERS:
        for model in _family(holder):
            model.model_rebuild(force=True)


def holds_kinds(model: M) -> M:
    """Class decorator of a model with a `KindUnion` field: rebuilt when the kinds change."""
    _HOLDERS.append(model)
    return model


def register(cls: K) -> K:
    """Class decorator: adds the kind, its wire tags checked free, and rebuilds the unions."""
    taken = {t for k in _REGISTRY for t in (k.name, *k.types, k.jev_type)}
    kind = cls()
    clash = taken & {kind.name, *kind.types}
    if clash and kind.name not in _REGISTRY.names():  # a name twice: the registry says so
        raise ValueError(f"question kind {kind.name!r}: type {sorted(clash)[0]!r} is taken")
    _REGISTRY.register(cls)
    _rebuild()
    return cls


def unregister(name: str) -> None:
    """Remove a kind (tests register toy ones and remove them again)."""
    _REGISTRY.unregister(name)
    _rebuild()


class KindUnion:
    """A pydantic type: the union of one model of every registered kind (`part`: "question",
    "answer" or "jev"), told apart by `type`, and then `extra`'s models. Built from the
    registry whenever a model holding it is (re)built."""

    part: ClassVar[str]
    extra: ClassVar[tuple[type[BaseModel], ...]] = ()

    @classmethod
    def __get_pydantic_core_schema__(cls, source: Any, handler: GetCoreSchemaHandler) -> CoreSchema:
        members = tuple(getattr(k, cls.part) for k in _REGISTRY) + cls.extra
        # The members are known at run time only: no type checker can read this union.
        union = Annotated[Union[members], Field(discriminator="type")]  # type: ignore[valid-type]  # noqa: UP007
        return handler.generate_schema(union)


# Every kind module of this package, in a fixed order (the registry's order, which is the
# unions' order in the published schemas): the three the contract started with, then by name.
_FIRST = ("yes_no", "choice", "score")
for _module in sorted(
    (m.name for m in pkgutil.iter_modules(__path__) if not m.name.startswith("_")),
    key=lambda n: (_FIRST.index(n) if n in _FIRST else len(_FIRST), n),
):
    importlib.import_module(f"{__name__}.{_module}")

"""The output formats a pipeline writes its results in, one module each, found by name.

Every module of this package not named with a leading underscore is imported here and
registers its `Format` subclass (`_base.py` says what one owns). The registry is the only
list of formats: the topology file's `output_format`, its options keys, the record's
`encode_output`, `read_output` and the exported JSON Schema files all read it.

Adding a format: a module here with a `@register`ed `Format` subclass, its tests, and its row
in docs/results.md ("Output formats"; a test checks every format has one).

`OutputFields` is what a pipeline says about its output, shared by the topology spec and
the worker's settings so that both have the same fields and checks: `output_format` and,
under each format's `options_key`, that format's options (validated whatever the format
chosen, as a pipeline may switch formats).
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Mapping, Set
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from dgstream.schemas.formats._base import Format, NoOptions
from dgstream.schemas.registry import Registry
from dgstream.schemas.request import Question

__all__ = [
    "DEFAULT_FORMAT",
    "Format",
    "NoOptions",
    "OutputFields",
    "format_names",
    "formats",
    "get_format",
    "register",
    "unregister",
]

DEFAULT_FORMAT = "dgstream"

# The reserved keys are the fields `OutputFields` holds besides the formats' options.
_REGISTRY: Registry[Format[Any]] = Registry(
    "output format",
    key_attr="options_key",
    key_kind="options key",
    home="schemas/formats/",
    reserved=lambda: set(_OutputFields.model_fields),
)
register = _REGISTRY.register
unregister = _REGISTRY.unregister
get_format = _REGISTRY.get
format_names = _REGISTRY.names


def formats() -> tuple[Format[Any], ...]:
    return tuple(_REGISTRY)


class _OutputFields(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    # How results are written: the name of an output format (`schemas/formats/`; the
    # table in docs/results.md lists each, with its options key). Dead letters are the same
    # in every format.
    output_format: str = DEFAULT_FORMAT

    @field_validator("output_format")
    @classmethod
    def _registered(cls, value: str) -> str:
        get_format(value)
        return value

    def output_options(self) -> BaseModel:
        """The options of the format chosen (its defaults when it has no options key)."""
        fmt = get_format(self.output_format)
        if fmt.options_key is None:
            return fmt.defaults
        options: BaseModel = getattr(self, fmt.options_key)
        return options

    def check_output_options(
        self, route_names: Set[str], question_sets: Mapping[str, Mapping[str, Question]]
    ) -> None:
        """Every format's options refer only to routes and questions the pipeline has."""
        for fmt in formats():
            if fmt.options_key is not None:
                fmt.check(getattr(self, fmt.options_key), route_names, question_sets)


def _build_output_fields() -> type[_OutputFields]:
    fields: dict[str, Any] = {}
    for key, fmt in _REGISTRY.keyed():
        doc = " ".join((fmt.options.__doc__ or "").split())
        described = Field(default_factory=fmt.options, description=doc)
        fields[key] = (fmt.options, described)
    model: type[_OutputFields] = create_model(
        "OutputFields", __base__=_OutputFields, __module__=__name__, **fields
    )
    return model


# Every format module of this package, in name order (the registry's order).
for _module in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if not _module.startswith("_"):
        importlib.import_module(f"{__name__}.{_module}")

if TYPE_CHECKING:
    # The options fields exist at run time only; code reads them with `output_options()`.
    OutputFields = _OutputFields
else:
    OutputFields = _build_output_fields()

"""What an output format is: the base class every format module subclasses.

A format is one module of `schemas/formats/` holding one `Format` subclass, decorated with
`schemas.formats.register`. It owns:

- `name`: what `output_format:` says in the topology file, and the record's
  `output_format` header;
- `encode`: a result's record value in this format;
- `options` (a frozen model with extra keys forbidden) and `options_key`, the pipeline's
  key that holds them (None: the format has no key, its options are their defaults);
- `response` and `schema_file`: the model a record's value validates against, and the file
  under `schemas/json/` that `python -m dgstream.schemas.export` writes from it;
- optional hooks, no-ops here: `recognises` (reading a value back in any format) and
  `check` (the options' references to the pipeline's routes and questions).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any, ClassVar, Generic, TypeVar

from pydantic import BaseModel, ConfigDict

from dgstream.schemas.request import Question
from dgstream.schemas.result import ClassificationResult

__all__ = ["Format", "NoOptions"]


class NoOptions(BaseModel):
    """The options of a format that has none: every format has an options model, so
    callers never special-case one without."""

    model_config = ConfigDict(frozen=True, extra="forbid")


Opts = TypeVar("Opts", bound=BaseModel)


class Format(Generic[Opts]):
    """One output format (see the module's docstring for what a subclass sets)."""

    name: ClassVar[str]
    options: type[Opts]
    options_key: ClassVar[str | None] = None
    response: ClassVar[type[BaseModel]]
    schema_file: ClassVar[str]

    def __init__(self) -> None:
        # Built once: a pipeline without options encodes every record with these.
        self.defaults: Opts = self.options()

    def encode(self, result: ClassificationResult, options: Opts) -> bytes:
        """The record value (UTF-8 JSON) of `result`."""
        raise NotImplementedError

    def recognises(self, obj: Mapping[str, Any]) -> bool:
        """Whether a decoded record value is in this format (`read_output`). The default
        format is what nothing else recognises, so it need not say."""
        return False

    def check(
        self,
        options: Opts,
        route_names: Set[str],
        question_sets: Mapping[str, Mapping[str, Question]],
    ) -> None:
        """Raise ValueError (its message starting with `options_key`) when the options name
        a route or question the pipeline does not have. `question_sets` is empty when
        requests bring their own questions."""
        return None

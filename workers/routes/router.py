"""Routes in the topology (`Route`), their checks when a pipeline loads (`check_routes`), and
the router the worker asks for each result's topic."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from dgstream.schemas import ClassificationResult
from dgstream.schemas.names import TOPIC_PATTERN
from dgstream.workers.routes.checks import check_condition
from dgstream.workers.routes.fields import RouteError, question_info
from dgstream.workers.routes.parser import Condition, parse_condition

MAX_ROUTES = 100

DEFAULT_ROUTE = "default"  # no route matched: the pipeline's output topic
REPLY_ROUTE = "reply"  # the request named its own reply_topic

_ROUTE_NAME = r"^[a-z0-9][a-z0-9_-]{0,62}$"


class Route(BaseModel):
    """One route: results for which `when` holds go to `topic`."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Names the route in metrics and errors: lower case, digits, "-" and "_"; not "default"
    # or "reply" (the results no route takes, and those for a request's reply topic).
    name: str = Field(pattern=_ROUTE_NAME)
    # The condition over the answers, e.g. `0.4 <= toxic.p_yes < 0.9` (docs/routes.md).
    when: str
    # Where the results for which `when` holds go.
    topic: str = Field(pattern=TOPIC_PATTERN)
    _condition: Condition | None = PrivateAttr(default=None)

    @model_validator(mode="after")
    def _parse(self) -> Route:
        if self.name in (DEFAULT_ROUTE, REPLY_ROUTE):
            raise ValueError(f"route {self.name!r}: the name is reserved")
        try:
            self._condition = parse_condition(self.when)
        except RouteError as exc:
            raise ValueError(f"route {self.name!r}: when: {exc}") from None
        return self

    @property
    def condition(self) -> Condition:
        assert self._condition is not None
        return self._condition


def check_routes(
    routes: Sequence[Route],
    question_sets: Sequence[Mapping[str, Any]] | None,
    *,
    forbidden_topics: Iterable[str] = (),
) -> None:
    """All load-time checks of a pipeline's routes; ValueError naming the route.

    `question_sets`: the pipeline's question sets (each id -> question), or None when it
    has none (its requests bring their own questions, whose ids cannot be known here)."""
    if len(routes) > MAX_ROUTES:
        raise ValueError(f"{len(routes)} routes; at most {MAX_ROUTES}")
    names = [r.name for r in routes]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"route names must be unique: {dup}")
    known = None if question_sets is None else question_info(*question_sets)
    forbidden = set(forbidden_topics)
    for i, route in enumerate(routes):
        where = f"routes[{i}] ({route.name})"
        if route.topic in forbidden:
            raise ValueError(f"{where}: topic {route.topic!r} is an input or dead-letter topic")
        try:
            check_condition(route.condition, known)
        except RouteError as exc:
            raise ValueError(f"{where}: when: {exc}") from None


class RouteMatch(NamedTuple):
    name: str
    topic: str


class Router:
    """Picks each result's topic: the request's reply topic, else the first route whose
    condition holds, else the default topic."""

    def __init__(self, routes: Sequence[Route], default_topic: str) -> None:
        self.routes = tuple(routes)
        self.default = RouteMatch(DEFAULT_ROUTE, default_topic)

    def route(self, result: ClassificationResult, reply_topic: str | None = None) -> RouteMatch:
        if reply_topic is not None:
            return RouteMatch(REPLY_ROUTE, reply_topic)
        for r in self.routes:
            if r.condition.evaluate(result):
                return RouteMatch(r.name, r.topic)
        return self.default

    @property
    def topics(self) -> list[str]:
        """Every topic a result may be routed to (the default first), without repeats."""
        return list(dict.fromkeys([self.default.topic, *(r.topic for r in self.routes)]))

"""Routes: where each result goes, decided by conditions over its answers.

The first route whose condition holds sends a result to its topic, else it goes to the
pipeline's output topic; a request's own `reply_topic` wins over both. Conditions are a
small expression language tokenized and parsed here (never `eval`), with three-valued logic
for fields that have no value; `check_condition` finds at load time what can be known to be
wrong: a comparison the field's range decides, or a whole condition no answer makes true.
The grammar, the fields and the checks: docs/routes.md.

The package, by job: `lexer` (tokens), `parser` (the tree and its types), `evaluate`
(three-valued evaluation), `fields` (what each field holds and what is known of the
questions), `checks` and `search` (the load-time checks), `router` (routes and the router).
"""

from dgstream.workers.routes.checks import check_condition
from dgstream.workers.routes.fields import (
    FIELDS,
    FieldSpec,
    QuestionInfo,
    RouteError,
    question_info,
)
from dgstream.workers.routes.lexer import tokenize
from dgstream.workers.routes.parser import (
    MAX_CONDITION_CHARS,
    MAX_NESTING,
    Condition,
    parse_condition,
)
from dgstream.workers.routes.router import (
    DEFAULT_ROUTE,
    MAX_ROUTES,
    REPLY_ROUTE,
    Route,
    RouteMatch,
    Router,
    check_routes,
)

__all__ = [
    "DEFAULT_ROUTE",
    "FIELDS",
    "MAX_CONDITION_CHARS",
    "MAX_NESTING",
    "MAX_ROUTES",
    "REPLY_ROUTE",
    "Condition",
    "FieldSpec",
    "QuestionInfo",
    "Route",
    "RouteError",
    "RouteMatch",
    "Router",
    "check_condition",
    "check_routes",
    "parse_condition",
    "question_info",
    "tokenize",
]

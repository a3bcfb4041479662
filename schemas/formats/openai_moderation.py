"""Results in OpenAI's moderation response shape (`output_format: openai_moderation`).

`{"id", "model", "results": [{"flagged", "categories", "category_scores",
"category_applied_input_types"}]}`, one entry (one input per request), which is what many
downstream services already parse (the `openai` SDK's `ModerationCreateResponse`).

A pipeline maps its yes/no questions to categories (`ModerationOptions.categories`,
category -> question id; by default every yes/no question is a category of its own name).
A category's score is the question's `p_yes` (calibrated, when the pipeline calibrates);
it is flagged when the score reaches its threshold. `flagged` is, as the pipeline says,
any category flagged (`flagged_by: thresholds`) or the result taken by a route
(`flagged_by: routes`, optionally only the routes named in `flag_routes`).

OpenAI's thirteen categories are always present, because the SDK's models require each: one
no question maps to is not flagged, scores 0 and applies to no input type (`[]`): it was not
asked. A category of a name of its own is added beside them.

`category_applied_input_types` says, per category, which of the request's inputs its score
applies to, as omni-moderation writes it: a list of "text" and/or "image" (OpenAI's API
reference, https://platform.openai.com/docs/api-reference/moderations/object, and the
`openai` SDK's `types.moderation.CategoryAppliedInputTypes`). A category answered on a
request whose images the engine read applies to ["text", "image"] (the one step read both),
on a text-only request to ["text"]. Except OpenAI's text-only categories (`TEXT_ONLY`:
harassment, hate, illicit and their subcategories, sexual/minors): omni-moderation scores
them from text alone and the SDK types their list as "text" only, so "image" there would make
`ModerationCreateResponse.model_validate` refuse the whole response; they say ["text"]. Which
images a result was read with is its audit's `images` (a pipeline always audits; a result
without an audit applies to text only).
"""

from __future__ import annotations

from collections.abc import Mapping, Set
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from dgstream.schemas._common import WireModel
from dgstream.schemas.formats import register
from dgstream.schemas.formats._base import Format
from dgstream.schemas.request import Question
from dgstream.schemas.result import ClassificationResult, YesNoAnswer

__all__ = [
    "OPENAI_CATEGORIES",
    "TEXT_ONLY",
    "ModerationOptions",
    "ModerationResponse",
    "ModerationResult",
    "OpenAIModeration",
    "to_moderation",
]

# The categories of OpenAI's moderation response (the openai SDK's `Categories`, 2026).
OPENAI_CATEGORIES: tuple[str, ...] = (
    "harassment",
    "harassment/threatening",
    "hate",
    "hate/threatening",
    "illicit",
    "illicit/violent",
    "self-harm",
    "self-harm/instructions",
    "self-harm/intent",
    "sexual",
    "sexual/minors",
    "violence",
    "violence/graphic",
)
# OpenAI's categories that omni-moderation scores from text only, whose applied input types
# the openai SDK types as `List[Literal["text"]]` (its `CategoryAppliedInputTypes`).
TEXT_ONLY: frozenset[str] = frozenset(
    {
        "harassment",
        "harassment/threatening",
        "hate",
        "hate/threatening",
        "illicit",
        "illicit/violent",
        "sexual/minors",
    }
)
InputType = Literal["text", "image"]
# Routes that do not flag: the results no route took, and those sent to a reply topic.
_NOT_A_ROUTE = ("default", "reply")


class ModerationOptions(BaseModel):
    """How a pipeline writes `openai_moderation` results: categories (-> yes/no question
    ids), thresholds, and whether `flagged` follows them or the routes (docs/decisions.md)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # Category -> the yes/no question whose p_yes is its score. Empty: every yes/no question
    # answered is a category of its own id.
    categories: dict[str, str] = Field(default_factory=dict)
    # A category is flagged when its score is at least its threshold (this one unless
    # `thresholds` names it). 0.5: the yes/no answer itself.
    threshold: float = Field(default=0.5, ge=0.0, le=1.0)
    thresholds: dict[str, float] = Field(default_factory=dict)
    # "thresholds": flagged when any category is; "routes": when a route took the result.
    flagged_by: Literal["thresholds", "routes"] = "thresholds"
    # With flagged_by "routes": only these routes flag (default: any route).
    flag_routes: list[str] | None = None

    @model_validator(mode="after")
    def _consistent(self) -> ModerationOptions:
        for name, value in self.thresholds.items():
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"thresholds.{name}: {value} is not within 0..1")
        unknown = set(self.thresholds) - set(self.categories) if self.categories else set()
        if unknown:
            raise ValueError(f"thresholds name categories not in categories: {sorted(unknown)}")
        if self.flag_routes is not None and self.flagged_by != "routes":
            raise ValueError('flag_routes needs flagged_by: "routes"')
        return self


class ModerationResult(WireModel):
    flagged: bool
    categories: dict[str, bool]
    category_scores: dict[str, float]
    category_applied_input_types: dict[str, list[InputType]] = Field(
        description='Category -> the inputs its score applies to: ["text"], ["text", "image"] '
        "(the request's images were read; not for OpenAI's text-only categories), or [] "
        "(not asked)."
    )


class ModerationResponse(WireModel):
    """One result in OpenAI's moderation response shape."""

    id: str = Field(description="The request's id.")
    model: str = Field(description="The model that answered (the pipeline's engine model).")
    results: list[ModerationResult] = Field(min_length=1, max_length=1)


def _scores(result: ClassificationResult, options: ModerationOptions) -> dict[str, float | None]:
    """Category -> p_yes of its question (None: not answered: skipped, or not yes/no)."""
    mapping = options.categories or {
        qid: qid for qid, a in result.answers.items() if isinstance(a, YesNoAnswer)
    }
    out: dict[str, float | None] = {}
    for category, qid in mapping.items():
        answer = result.answers.get(qid)
        out[category] = answer.p_yes if isinstance(answer, YesNoAnswer) else None
    return out


def _read_images(result: ClassificationResult) -> bool:
    """Whether the result was read with images (its audit names them)."""
    return result.audit is not None and bool(result.audit.images)


def to_moderation(
    result: ClassificationResult, options: ModerationOptions | None = None
) -> ModerationResponse:
    """`result` in OpenAI's moderation shape. `flagged_by: routes` reads the route from the
    result's audit (a result without one is not flagged by a route)."""
    opts = options or ModerationOptions()
    scores = _scores(result, opts)
    names = [*OPENAI_CATEGORIES, *(c for c in scores if c not in OPENAI_CATEGORIES)]
    categories: dict[str, bool] = {}
    category_scores: dict[str, float] = {}
    applied: dict[str, list[InputType]] = {}
    read: list[InputType] = ["text", "image"] if _read_images(result) else ["text"]
    for name in names:
        score = scores.get(name)
        limit = opts.thresholds.get(name, opts.threshold)
        categories[name] = score is not None and score >= limit
        category_scores[name] = 0.0 if score is None else score
        if score is None:
            applied[name] = []
        else:
            applied[name] = ["text"] if name in TEXT_ONLY else list(read)
    if opts.flagged_by == "thresholds":
        flagged = any(categories.values())
    else:
        route = result.audit.route if result.audit is not None else "default"
        wanted = opts.flag_routes
        flagged = route not in _NOT_A_ROUTE and (wanted is None or route in wanted)
    return ModerationResponse(
        id=result.id,
        model=result.diagnostics.model,
        results=[
            ModerationResult(
                flagged=flagged,
                categories=categories,
                category_scores=category_scores,
                category_applied_input_types=applied,
            )
        ],
    )


@register
class OpenAIModeration(Format[ModerationOptions]):
    name = "openai_moderation"
    options = ModerationOptions
    options_key = "moderation"
    response = ModerationResponse
    schema_file = "openai_moderation_result.schema.json"

    def encode(self, result: ClassificationResult, options: ModerationOptions) -> bytes:
        return to_moderation(result, options).model_dump_json().encode()

    def recognises(self, obj: Mapping[str, Any]) -> bool:
        return "results" in obj and "answers" not in obj

    def check(
        self,
        options: ModerationOptions,
        route_names: Set[str],
        question_sets: Mapping[str, Mapping[str, Question]],
    ) -> None:
        """Its routes exist, and (with question sets) each category names a yes/no question
        of one of them."""
        unknown = sorted(set(options.flag_routes or ()) - route_names)
        if unknown:
            raise ValueError(f"moderation.flag_routes: no route named {unknown}")
        if options.flagged_by == "routes" and not route_names:
            raise ValueError('moderation.flagged_by "routes" needs routes')
        if not question_sets:
            return  # requests bring their own questions: their ids cannot be known here
        yes_no = {
            qid for qs in question_sets.values() for qid, q in qs.items() if q.kind == "yes_no"
        }
        for category, qid in options.categories.items():
            if qid not in yes_no:
                raise ValueError(
                    f"moderation.categories.{category}: {qid!r} is no yes/no question of the "
                    "pipeline's question sets"
                )

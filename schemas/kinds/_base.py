"""What a question kind is: the base class every kind module subclasses, and the parts of a
question and of an answer every kind shares.

A kind is one module of `schemas/kinds/` holding one `Kind` subclass, decorated with
`schemas.kinds.register`. It owns:

- `name`: the normalized kind (`Question.kind`, its answer's `type`, the `kind` of a
  question in a calibration file) and `types`, the question `type`s it takes on the wire;
- `question`, `answer` and `jev`: its request model, its result model and its answer in
  Jev's response shape (`output_format: jev`), each with its `type` tag;
- `criteria_codes`: the error code of a pydantic check on its `criteria` (a count);
- for the engine: `labels` (the tokens the model writes at its slot, one per answer;
  `shared_labels`: those every engine resolves once), `prompt` (its lines in the system
  text) and `answer_fields` (its answer's own fields from the aggregated reads, which
  `build` completes); the prompt's text is versioned by
  `workers.engine.template.PROMPT_TEMPLATE_VERSION`;
- for the routes: `fields` (the route fields only it has), `value` (a field's value) and
  `field_range` (a number field's range for a question's number of answers);
- for calibration: `distribution` (a written answer, ours or Jev's, as names and
  probabilities) and `calibrated` (an answer with its probabilities tempered);
- `answer_field`: its answer's field naming the answer given (`answer_name`, the route
  field `label`); `line`, `headline` and `compared`: what the commands show of an answer.

The base class gives the shapes the kinds share: `build` (the answer's own fields, then
`confidence`, `stderr` and `agreement`), `answer_name` (`answer_field`'s value), `value`
(the answer's attribute of a route field's name), and, for an answer with `probabilities`
(name -> probability, in order) and `raw_probabilities`, `distribution` (with `named` for
a Jev shape keyed otherwise) and `calibrated` (with `tempered` for fields that follow the
probabilities). A kind overrides only what differs.

Nothing here knows the engine: `build` reads any object with the aggregate's fields
(`Aggregated`), so a kind needs no import of `workers/`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, Protocol

from pydantic import BeforeValidator, Field, StringConstraints, field_validator

from dgstream.schemas._common import RequestModel, WireModel, fail
from dgstream.schemas.content import CONTENT_SCHEMA, to_text
from dgstream.schemas.errors import ErrorCode

__all__ = [
    "MAX_INSTRUCTIONS_CHARS",
    "Aggregated",
    "Answered",
    "Instructions",
    "Kind",
    "Probability",
    "QuestionBase",
    "RouteField",
    "clean",
    "heading",
]

MAX_INSTRUCTIONS_CHARS = 2000

Probability = Annotated[float, Field(ge=0.0, le=1.0)]

Instructions = Annotated[
    str,
    StringConstraints(min_length=1, max_length=MAX_INSTRUCTIONS_CHARS),
    BeforeValidator(to_text),
    CONTENT_SCHEMA,
]


# --- questions ----------------------------------------------------------------------------------


class QuestionBase(RequestModel):
    type: str  # narrowed to a Literal by each kind; declared here so it comes first
    instructions: Instructions | None = Field(
        default=None,
        description="What to decide: text, or a JSON object or array (read as its JSON text); "
        "at most 2000 characters as text, not blank. Null or left out: the question has no "
        "instruction line (a yes/no question then needs a described outcome).",
    )
    depends_on: list[str] = Field(
        default_factory=list,
        description="Ids of questions whose answers go into this question's prompt; this "
        "question is asked after them.",
    )
    ask_if: dict[str, list[str]] | None = Field(
        default=None,
        description="Question id -> answers of that question for which this one is asked "
        "(yes/no: 'yes'/'no'; choice: option names; score: level names). Implies the "
        "dependency. When not met, the answer is of type 'skipped'.",
    )

    @field_validator("instructions")
    @classmethod
    def _instructions_not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise fail(ErrorCode.EMPTY_INSTRUCTIONS, "instructions are blank")
        return value

    @property
    def kind(self) -> str:
        """The normalized kind: the name of the `Kind` whose `types` hold this `type` ("yes_no"
        for both "noul" and "yes_no")."""
        from dgstream.schemas.kinds import kind_of_type

        kind = kind_of_type(self.type)
        assert kind is not None, self.type  # the union admits registered types only
        return kind.name

    @property
    def answers(self) -> tuple[str, ...]:
        """The values an answer can take, in order (also what `ask_if` lists)."""
        raise NotImplementedError

    @property
    def labels(self) -> tuple[str, ...]:
        """Same as `answers`: answer names, not the label tokens the engine writes."""
        return self.answers

    @property
    def prerequisites(self) -> tuple[str, ...]:
        """Ids this question waits for: `depends_on`, then `ask_if` keys, without repeats."""
        return tuple(dict.fromkeys([*self.depends_on, *(self.ask_if or {})]))


# --- answers ------------------------------------------------------------------------------------


class Answered(WireModel):
    # Each kind's answer adds its `type` (the kind's name) after these: the written order.
    confidence: Probability = Field(description="Probability of the answer given (the max).")
    stderr: float | None = Field(
        default=None,
        ge=0.0,
        description="Standard error, across reads, of the probability behind `confidence`; "
        "null with one read.",
    )
    agreement: Probability | None = Field(
        default=None,
        description="Share of reads whose own argmax is the final answer; null with one read.",
    )


class Aggregated(Protocol):
    """What `Kind.build` reads of a question's reads combined (the engine's `Aggregate`)."""

    # The mean probabilities, in the answers' order (the engine's is a numpy array).
    @property
    def mean(self) -> Any: ...
    @property
    def confidence(self) -> float: ...
    @property
    def argmax(self) -> int: ...
    @property
    def stderr(self) -> float | None: ...
    @property
    def agreement(self) -> float | None: ...


def clean(p: float) -> float:
    # Keep results readable and stable in JSON: probabilities to 6 decimals.
    return round(float(p), 6)


def heading(qid: str, what: str, instructions: str | None) -> str:
    """A question's first line in the system text."""
    # Without instructions (a Jev question may leave them out) the heading stands alone.
    head = f"Question {qid} ({what})"
    return head if instructions is None else f"{head}: {instructions}"


# --- route fields -------------------------------------------------------------------------------

ValueType = Literal["number", "text", "bool"]


class RouteField(NamedTuple):
    """A field a route condition reads (`question.field`): its type and, for a number, the
    range a value can take (a kind may narrow it per question: `Kind.field_range`)."""

    type: ValueType
    low: float = float("-inf")
    high: float = float("inf")


# --- the kind -----------------------------------------------------------------------------------


class Kind:
    """One question kind (see the module's docstring for what a subclass sets)."""

    name: ClassVar[str]
    types: ClassVar[tuple[str, ...]]
    question: ClassVar[type[QuestionBase]]
    answer: ClassVar[type[Answered]]
    jev: ClassVar[type[WireModel]]
    criteria_codes: ClassVar[Mapping[str, ErrorCode]] = {}
    fields: ClassVar[Mapping[str, RouteField]] = {}
    # The labels an engine resolves once for every read (its shared label set); a read
    # whose labels are not all among them asks for its own.
    shared_labels: ClassVar[tuple[str, ...]] = ()
    # Its answer's main number, a field of `answer` (the demo's table shows it).
    headline: ClassVar[str] = "confidence"
    # The answers whose probability shift `dgstream compare` reports (None: every one).
    compared: ClassVar[tuple[str, ...] | None] = None
    # The field of `answer` holding the name of the answer given (`answer_name`).
    answer_field: ClassVar[str]

    @property
    def jev_type(self) -> str:
        """The `type` of its answer in Jev's shape."""
        tag: str = self.jev.model_fields["type"].default
        return tag

    # ------------------------------------------------------------------ the engine

    def labels(self, question: Any) -> tuple[str, ...]:
        """The label tokens the model writes at the slot, one per answer, in order."""
        raise NotImplementedError

    def prompt(self, qid: str, question: Any, labels: Sequence[str]) -> list[str]:
        """Its lines in the system text (the `Labels:` line that ends every question is
        the template's)."""
        raise NotImplementedError

    def answer_fields(self, agg: Aggregated, answers: Sequence[str]) -> dict[str, Any]:
        """Its answer's own fields from the reads combined (`agg.mean` in the order of
        `answers`): all but `type`, `confidence`, `stderr` and `agreement`."""
        raise NotImplementedError

    def build(self, agg: Aggregated, answers: Sequence[str]) -> Answered:
        """The answer from the reads combined (`agg.mean` in the order of `answers`): its
        `type` (the kind's name), its own fields, then the reads' confidence, standard error
        and agreement."""
        return self.answer(
            **{
                "type": self.name,
                **self.answer_fields(agg, answers),
                "confidence": clean(agg.confidence),
                "stderr": agg.stderr,
                "agreement": agg.agreement,
            }
        )

    # ------------------------------------------------------------------ reading an answer

    def answer_name(self, answer: Any) -> str:
        """The name of the answer given: its `answer_field`."""
        name: str = getattr(answer, self.answer_field)
        return name

    def line(self, answer: Mapping[str, Any]) -> str:
        """The answer in a few words for a terminal (`dgstream tail`), from its written JSON
        in our shape or Jev's."""
        raise NotImplementedError

    def value(self, answer: Any, field: str) -> Any:
        """The value of one of its own `fields` in `answer` (None: it has none): by default
        the answer's attribute of that name."""
        return getattr(answer, field) if field in self.fields else None

    def field_range(self, field: str, answers: int) -> tuple[float, float] | None:
        """A number field's range for a question of `answers` answers (None: the field's)."""
        return None

    def to_jev(self, answer: Any) -> WireModel:
        """The answer in Jev's shape."""
        raise NotImplementedError

    # ------------------------------------------------------------------ calibration

    def distribution(
        self, answer: Mapping[str, Any], raw: bool
    ) -> tuple[tuple[str, ...], tuple[float, ...]] | None:
        """A written answer (ours or Jev's shape, as decoded JSON) as its answer names and
        probabilities; `raw`: the engine's, when it was calibrated. None: unreadable. By
        default its `probabilities` (`raw_probabilities` when `raw` and written), keyed by
        answer name as `named` keys them."""
        probs = (answer.get("raw_probabilities") if raw else None) or answer.get("probabilities")
        if not isinstance(probs, Mapping):
            return None
        probs = self.named(answer, probs)
        return tuple(str(k) for k in probs), tuple(float(probs[k]) for k in probs)

    def named(self, answer: Mapping[str, Any], probs: Mapping[Any, Any]) -> Mapping[Any, Any]:
        """A written answer's probabilities keyed by answer name (as written, by default;
        a Jev shape may key them otherwise)."""
        return probs

    def calibrated(
        self,
        answer: Any,
        labels: Sequence[str],
        temper: Callable[[Sequence[float]], list[float]],
    ) -> Answered | None:
        """`answer` with its probabilities tempered (`temper` maps probabilities in order),
        the engine's kept beside them; None when `labels` (a calibration file's answer
        names) are not its answers. By default its `probabilities` tempered, `confidence`
        the answer given's, `raw_probabilities` the engine's, and what `tempered` adds."""
        names = list(answer.probabilities)
        if names != list(labels):
            return None
        probs = dict(zip(names, temper(list(answer.probabilities.values())), strict=True))
        updated: Answered = answer.model_copy(
            update={
                "probabilities": probs,
                "confidence": probs[self.answer_name(answer)],
                "raw_probabilities": dict(answer.probabilities),
                **self.tempered(answer, probs),
            }
        )
        return updated

    def tempered(self, answer: Any, probs: Mapping[str, float]) -> dict[str, Any]:
        """Fields of `answer` that follow its tempered probabilities (`probs`, by name),
        beside those `calibrated` sets (none, by default)."""
        return {}

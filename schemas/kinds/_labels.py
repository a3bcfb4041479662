"""The rules on option and level names, shared by the kinds whose answers are named by the
request (choice, score): a model is asked about them and a reviewer reads them
(`schemas.names`: `label_defect`, `label_key`). The published schema and the errors say so."""

from __future__ import annotations

from collections.abc import Iterable

from dgstream.schemas._common import fail, has_control
from dgstream.schemas.errors import ErrorCode
from dgstream.schemas.names import label_defect, label_key

LABEL_RULES = (
    "without bidirectional controls or invisible characters (zero-width, soft hyphen, "
    "variation selectors, tags; a ZWJ or ZWNJ only where a script or an emoji joins with "
    "it), and unique as Unicode NFKC with case folded, spacing and invisible characters "
    "ignored."
)
PLAIN = "a label must read as what it is"
COMPARED = "names are compared as Unicode NFKC, ignoring case, spacing and invisible characters"


def alike(name: str, other: str) -> str:
    """`name repeats other`, with their code points when the two would print alike."""
    if name != other and not (name.isascii() and other.isascii()):
        return f"{name!r} repeats {other!r}: {name!a} and {other!a}"
    return f"{name!r} repeats {other!r}"


def check_names(
    names: Iterable[str],
    *,
    noun: str,
    invalid: ErrorCode,
    duplicate: ErrorCode,
    max_chars: int | None = None,
    repeat_note: str = "",
) -> None:
    """Refuse the first name that is blank, too long (when `max_chars`), holds a control
    character or a defect, or repeats another as `label_key` compares them."""
    seen: dict[str, str] = {}
    for name in names:
        too_long = max_chars is not None and len(name) > max_chars
        if not name.strip() or too_long or has_control(name):
            rule = (
                f"must be 1..{max_chars} characters, not blank, without control characters"
                if max_chars is not None
                else "must not be blank or hold control characters"
            )
            raise fail(invalid, f"{noun} name {name!r} {rule}")
        defect = label_defect(name)
        if defect is not None:
            raise fail(invalid, f"{noun} name {name!r} holds {defect}: {PLAIN}")
        key = label_key(name)
        if key in seen:
            raise fail(duplicate, f"{noun} {alike(name, seen[key])} ({COMPARED}){repeat_note}")
        seen[key] = name

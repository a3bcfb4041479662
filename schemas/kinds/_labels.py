"""The rules on option and level names, shared by the kinds whose answers are named by the
request (choice, score): a model is asked about them and a reviewer reads them
(`schemas.names`: `label_defect`, `label_key`). The published schema and the errors say so."""

from __future__ import annotations

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

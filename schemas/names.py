"""The names the contract shares with the worker and the topology, each written once.

- A Kafka topic name: Kafka's own rule (letters, digits, `.`, `_`, `-`; at most 249
  characters; not `.` or `..`).
- A question id: a letter, then letters, digits or `_`, 64 characters at most; it appears
  in the answer template the model reads (`id: label`), so it must be one plain word. Being
  ASCII, it has no look-alike forms: no compatibility form, no invisible character.
- A label: a choice's option name or a score's level name. The model is asked about it and a
  reviewer reads it in the result, so it must read as what it is (`label_defect`), and two
  labels of one question must not read alike (`label_key`).
"""

from __future__ import annotations

import functools
import re
import unicodedata

__all__ = [
    "BIDI_CONTROLS",
    "DEPLOYMENT_NAME_PATTERN",
    "QUESTION_ID_PATTERN",
    "TOPIC_CHARS",
    "TOPIC_PATTERN",
    "is_question_id",
    "is_topic_name",
    "label_defect",
    "label_key",
]

TOPIC_CHARS = "a-zA-Z0-9._-"  # a regex character class's body
TOPIC_PATTERN = rf"^[{TOPIC_CHARS}]{{1,249}}$"
QUESTION_ID_PATTERN = r"^[A-Za-z][A-Za-z0-9_]{0,63}$"
# Pipeline and deployment names: they go into Ray actor names and Kubernetes labels (a DNS
# label: 63 characters, lower-case alphanumerics and '-', alphanumeric at both ends).
DEPLOYMENT_NAME_PATTERN = r"^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$"

_TOPIC = re.compile(TOPIC_PATTERN)
_QUESTION_ID = re.compile(QUESTION_ID_PATTERN)


def is_topic_name(name: str) -> bool:
    return _TOPIC.fullmatch(name) is not None and name not in (".", "..")


def is_question_id(qid: str) -> bool:
    return _QUESTION_ID.fullmatch(qid) is not None


# --- labels ---------------------------------------------------------------------------------------
#
# A label may be in any script, but a reviewer who reads "yes" must be reading what the model
# was asked. Two things break that, and each is refused where it is found:
# - characters that change how a label displays without showing themselves (bidirectional
#   controls, zero-width and other default-ignorable characters): `label_defect`;
# - two labels of one question that differ only in form (case, spacing, composed or decomposed
#   accents, full-width or compatibility forms, invisible characters): `label_key`.

# Unicode's Bidi_Control property (PropList.txt): the Arabic letter mark, the LTR/RTL marks,
# embeddings, overrides, pop, and isolates. They reorder or re-direct the text around them
# (the "Trojan Source" attack, CVE-2021-42574) and no label needs one: a label written in one
# right-to-left script displays right by the bidirectional algorithm alone.
BIDI_CONTROLS = frozenset(
    "\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069"
)
_ZWNJ, _ZWJ = "\u200c", "\u200d"
_TEXT_VS, _EMOJI_VS = "\ufe0e", "\ufe0f"
_KEYCAP = "\u20e3"
_JOINERS = frozenset((_ZWNJ, _ZWJ, _TEXT_VS, _EMOJI_VS))
# Unicode's Default_Ignorable_Code_Point (DerivedCoreProperties.txt; the test of this module
# compares the table with the regex module's Unicode data): characters a renderer shows as
# nothing. Python 3.11's unicodedata (Unicode 14) has no such property, and not all of them
# are format characters (the Hangul fillers are letters, the variation selectors marks). Tag
# characters (U+E0020..E007F) are among them: invisible ASCII that language models read
# ("ASCII smuggling").
_DEFAULT_IGNORABLE = (
    (0x00AD, 0x00AD),
    (0x034F, 0x034F),
    (0x061C, 0x061C),
    (0x115F, 0x1160),
    (0x17B4, 0x17B5),
    (0x180B, 0x180F),
    (0x200B, 0x200F),
    (0x202A, 0x202E),
    (0x2060, 0x206F),
    (0x3164, 0x3164),
    (0xFE00, 0xFE0F),
    (0xFEFF, 0xFEFF),
    (0xFFA0, 0xFFA0),
    (0xFFF0, 0xFFF8),
    (0x1BCA0, 0x1BCA3),
    (0x1D173, 0x1D17A),
    (0xE0000, 0xE0FFF),
)
# The other format characters (category Cf, as the regex module's newer Unicode data and
# Python's own have them; the test checks both):
# Arabic and Kaithi number signs, the Syriac abbreviation mark and the end of ayah, which
# span or prefix the characters after them, and the interlinear annotation and Egyptian
# hieroglyph format controls.
_OTHER_FORMAT = (
    (0x0600, 0x0605),
    (0x06DD, 0x06DD),
    (0x070F, 0x070F),
    (0x0890, 0x0891),
    (0x08E2, 0x08E2),
    (0xFFF9, 0xFFFB),
    (0x110BD, 0x110BD),
    (0x110CD, 0x110CD),
    (0x13430, 0x1343F),
)
# Not default-ignorable, yet drawn as an empty cell: the usual stand-in for a blank name.
_BLANK_GLYPHS = frozenset("\u2800")  # BRAILLE PATTERN BLANK
_LINE_BREAKS = frozenset("\u2028\u2029")  # LINE and PARAGRAPH SEPARATOR (Zl, Zp)


def _char_class(ranges: tuple[tuple[int, int], ...]) -> str:
    return "".join(f"\\U{lo:08x}-\\U{hi:08x}" for lo, hi in ranges)


# Found by `re` rather than by a loop over every character: a level name has no length
# limit of its own, so a hostile one may be most of a 1 MiB record.
_IGNORABLE_RE = re.compile(f"[{_char_class(_DEFAULT_IGNORABLE)}]")
# Every character `label_defect` looks at twice.
_SUSPECT_RE = re.compile(
    f"[{_char_class(_DEFAULT_IGNORABLE + _OTHER_FORMAT)}\\u2028\\u2029\\u2800\\ud800-\\udfff]"
)
# Scripts whose letters join (cursive): a zero-width non-joiner between two of their letters
# is spelling, e.g. Persian "می\u200cخواهم" (RFC 5892 A.1 asks for Joining_Type, which Python's
# unicodedata lacks; the script of a letter is the first words of its name).
_JOINING_SCRIPTS = (
    "ADLAM ",
    "ARABIC ",
    "CHORASMIAN ",
    "HANIFI ROHINGYA ",
    "MANDAIC ",
    "MANICHAEAN ",
    "MONGOLIAN ",
    "NKO ",
    "OLD UYGHUR ",
    "PHAGS-PA ",
    "PSALTER PAHLAVI ",
    "SOGDIAN ",
    "SYRIAC ",
)
# Emoji skin-tone modifiers: part of the emoji before a ZWJ, as a variation selector is.
_SKIN_TONES = range(0x1F3FB, 0x1F400)
# Emoji whose character is not an "other symbol" (So): the punctuation, letter and math
# members of Unicode's Extended_Pictographic (‼ ⁉ ℹ ↔ ◻ ◼ ◽ ◾ ⤴ ⤵ 〰 〽).
_OTHER_PICTOGRAPHS = frozenset(
    "\u203c\u2049\u2139\u2194\u25fb\u25fc\u25fd\u25fe\u2934\u2935\u3030\u303d"
)
# Emoji newer than Python's Unicode data (14.0 on 3.11) are unassigned there; Unicode keeps
# these planes' unassigned code points for pictographs (Extended_Pictographic holds them).
_PICTOGRAPH_PLANE = range(0x1F000, 0x20000)


def _is_default_ignorable(char: str) -> bool:
    return _IGNORABLE_RE.match(char) is not None


def _is_virama(char: str) -> bool:
    # A virama (canonical combining class 9) before a ZWJ or ZWNJ picks a conjunct or a half
    # form in Brahmic scripts (Devanagari "क्\u200dष", Sinhala "ශ්\u200dරී"): RFC 5892 A.1 and A.2.
    return unicodedata.combining(char) == 9


def _letter_around(name: str, i: int, step: int) -> str:
    """The nearest character before (step -1) or after (step 1) position i that is not a
    combining mark (marks are transparent to joining), or ""."""
    j = i + step
    while 0 <= j < len(name) and unicodedata.category(name[j]) in ("Mn", "Me"):
        j += step
    return name[j] if 0 <= j < len(name) else ""


@functools.lru_cache(maxsize=4096)
def _joins(char: str) -> bool:
    return (
        char != ""
        and unicodedata.category(char).startswith("L")
        and unicodedata.name(char, "").startswith(_JOINING_SCRIPTS)
    )


def _pictographic(char: str) -> bool:
    """Whether `char` is an emoji's picture (Unicode's Extended_Pictographic, near enough)."""
    if char == "":
        return False
    category = unicodedata.category(char)
    return (
        category == "So"
        or char in _OTHER_PICTOGRAPHS
        or (category == "Cn" and ord(char) in _PICTOGRAPH_PLANE)
    )


def _emoji_before(name: str, i: int) -> bool:
    """Whether an emoji (a picture, with its variation selector or skin tone) ends at i - 1."""
    j = i - 1
    while j >= 0 and (name[j] == _EMOJI_VS or ord(name[j]) in _SKIN_TONES):
        j -= 1
    return j >= 0 and _pictographic(name[j])


def _allowed_in_context(name: str, i: int) -> bool:
    """Whether the invisible character at i is spelling where it stands (never a bidi control)."""
    char = name[i]
    before = name[i - 1] if i > 0 else ""
    after = name[i + 1] if i + 1 < len(name) else ""
    if char in (_ZWJ, _ZWNJ) and before and _is_virama(before):
        return True
    if char == _ZWNJ:
        return _joins(_letter_around(name, i, -1)) and _joins(_letter_around(name, i, 1))
    if char == _ZWJ:  # an emoji ZWJ sequence: "👩\u200d⚕\ufe0f", "🏳\ufe0f\u200d🌈"
        return _emoji_before(name, i) and _pictographic(after)
    if char in (_TEXT_VS, _EMOJI_VS) and before:
        # Text or emoji presentation of an emoji (emoji-variation-sequences.txt): after its
        # picture, or in a keycap ("1\ufe0f⃣"); after anything else it shows nothing.
        if before in "0123456789#*":
            return after == _KEYCAP
        return _pictographic(before)
    return False


def _describe(char: str) -> str:
    return f"U+{ord(char):04X} {unicodedata.name(char, 'unnamed')}"


def label_defect(name: str) -> str | None:
    """Why `name` cannot be a label as it stands (a phrase naming the first offending
    character), or None. Control characters, blanks and length are the caller's checks.

    Refused: bidirectional controls anywhere; default-ignorable characters (zero-width
    space, word joiner, BOM, soft hyphen, variation selectors, tags, Hangul fillers, ...)
    and other format characters (Unicode category Cf), except a ZWJ or ZWNJ after a virama,
    a ZWNJ between two letters of a joining script, a ZWJ between two emoji, and VS15 or
    VS16 after an emoji or a keycap's digit; line and paragraph separators; lone
    surrogates; the blank braille pattern."""
    if name.isascii():  # no ASCII character is invisible, a format character or a break
        return None
    for found in _SUSPECT_RE.finditer(name):
        i, char = found.start(), found.group()
        if char in BIDI_CONTROLS:
            return f"a bidirectional control ({_describe(char)})"
        if char in _LINE_BREAKS:
            return f"a line break ({_describe(char)})"
        if "\ud800" <= char <= "\udfff":
            return f"a lone surrogate (U+{ord(char):04X})"
        if char in _BLANK_GLYPHS:
            return f"a character drawn blank ({_describe(char)})"
        if not _allowed_in_context(name, i):
            where = " outside the joins a script or an emoji needs" if char in _JOINERS else ""
            return f"an invisible character ({_describe(char)}){where}"
    return None


def _visible(text: str) -> str:
    return _IGNORABLE_RE.sub("", text)


def label_key(name: str) -> str:
    """The one form of a label under which two labels are the same label.

    Unicode's compatibility caseless match (The Unicode Standard, D146: NFKD, case folding,
    NFKD and folding again, so that "ﬁ", "FI" and "fi" meet, as do "café" composed and
    decomposed and "ｙｅｓ" and "yes"), with default-ignorable characters dropped (as
    Unicode's NFKC_Casefold drops them) and runs of white space made one space, none at
    the ends. Returned in NFC, to be compared, never shown."""
    if name.isascii():  # ASCII is its own NFKD, and folds as it lowers
        return " ".join(name.lower().split())
    text = unicodedata.normalize("NFD", _visible(name)).casefold()
    text = unicodedata.normalize("NFKD", unicodedata.normalize("NFKD", text).casefold())
    return " ".join(unicodedata.normalize("NFC", _visible(text)).split())

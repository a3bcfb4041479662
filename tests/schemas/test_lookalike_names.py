"""Labels (option and level names) read as what they are, and two labels of one question
never read alike.

- A name holding a bidirectional control, or an invisible character where no script or
  emoji needs one, is refused where it stands: INVALID_OPTION_NAME / INVALID_LEVEL_NAME.
- Two names equal under `schemas.names.label_key` (NFKC with case folded, spacing and
  invisible characters ignored) are refused as DUPLICATE_OPTION / DUPLICATE_LEVEL.

The tables are written by hand (their own oracle); the properties tie the parser to the
normalisation; Unicode's own character data (the `regex` module's, which transformers
installs) checks the tables of code points in `schemas.names`.
"""

from __future__ import annotations

import json
import unicodedata
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dgstream.schemas import ClassificationRequest, ErrorCode, RequestError, parse_request
from dgstream.schemas.names import BIDI_CONTROLS, is_question_id, label_defect, label_key
from dgstream.schemas.request import MAX_OPTION_CHARS

pytestmark = pytest.mark.unit

E = ErrorCode
PROPERTY = settings(
    database=None,
    deadline=None,
    max_examples=300,
    suppress_health_check=[HealthCheck.too_slow],
)


def _choice(*names: str) -> dict[str, Any]:
    return {"type": "choice", "instructions": "Which?", "criteria": dict.fromkeys(names)}


def _score(*names: str) -> dict[str, Any]:
    return {"type": "score", "instructions": "How much?", "criteria": list(names)}


def _parse(question: dict[str, Any], qid: str = "category") -> ClassificationRequest | RequestError:
    body = {"id": "r1", "state": "text", "questions": {qid: question}}
    return parse_request(json.dumps(body, ensure_ascii=False).encode("utf-8"))


def _refused(question: dict[str, Any], qid: str = "category") -> RequestError:
    got = _parse(question, qid)
    assert isinstance(got, RequestError), f"accepted: {question['criteria']!r}"
    return got


def _accepted(question: dict[str, Any]) -> ClassificationRequest:
    got = _parse(question)
    assert isinstance(got, ClassificationRequest), str(got)
    return got


# --------------------------------------------------------------------------- look-alikes

# (first, second): two spellings of one label. Each is a valid name on its own.
LOOKALIKE_PAIRS = [
    pytest.param("café", "cafe\u0301", id="composed-vs-decomposed"),
    pytest.param("Spam", " spam", id="case-and-surrounding-space"),
    pytest.param("yes", "ｙｅｓ", id="full-width"),
    pytest.param("fine", "ﬁne", id="ligature"),
    pytest.param("Straße", "STRASSE", id="sharp-s-folds-to-ss"),
    pytest.param("ΟΔΟΣ", "οδος", id="greek-final-sigma"),
    pytest.param("not spam", "not\u00a0\u2003 spam", id="inner-spacing-nbsp-em-space"),
    pytest.param("x2", "x²", id="superscript"),
    pytest.param("IV", "Ⅳ", id="roman-numeral"),
    pytest.param("kg", "㎏", id="square-unit"),
    pytest.param("k", "\u212a", id="kelvin-sign"),
    pytest.param("Ångström", "\u212bngstr\u00f6m", id="angstrom-sign"),
    pytest.param("dž", "ǅ", id="digraph-titlecase"),
    pytest.param("❤", "❤\ufe0f", id="emoji-presentation-selector"),
    pytest.param("نمی\u200cدانم", "نمیدانم", id="persian-with-and-without-zwnj"),
    pytest.param("ශ්\u200dරී", "ශ්රී", id="sinhala-with-and-without-zwj"),
]


@pytest.mark.parametrize(("first", "second"), LOOKALIKE_PAIRS)
def test_lookalike_options_are_duplicates(first: str, second: str) -> None:
    for name in (first, second):  # each is a good name alone
        _accepted(_choice(name, "other"))
    err = _refused(_choice(first, second))
    assert err.code is E.DUPLICATE_OPTION
    assert err.field == "questions.category.criteria"
    assert err.message.startswith("questions.category.criteria: ")
    assert "NFKC" in err.message
    assert label_key(first) == label_key(second)


@pytest.mark.parametrize(("first", "second"), LOOKALIKE_PAIRS)
def test_lookalike_levels_are_duplicates(first: str, second: str) -> None:
    err = _refused(_score("zero", first, second), qid="severity")
    assert (err.code, err.field) == (E.DUPLICATE_LEVEL, "questions.severity.criteria")
    assert err.message.startswith("questions.severity.criteria: ")


def test_a_duplicate_message_shows_code_points_when_the_names_print_alike() -> None:
    err = _refused(_choice("café", "cafe\u0301"))
    assert "'caf\\xe9'" in err.message and "'cafe\\u0301'" in err.message


def test_a_jev_body_is_held_to_the_same_rules() -> None:
    body = {
        "model": "jev-latest",
        "state": {"text": "hi"},
        "questions": {"tone": {"type": "choice", "criteria": {"calm": None, "CALM\u200b": None}}},
    }
    from dgstream.schemas import FallbackId

    err = parse_request(json.dumps(body).encode(), fallback_id=FallbackId("k", "key"))
    assert isinstance(err, RequestError)
    assert (err.code, err.field) == (E.INVALID_OPTION_NAME, "questions.tone.criteria")


# Different labels that a careless normalisation would merge: they read differently.
DISTINCT_PAIRS = [
    ("yes", "no"),
    ("resume", "résumé"),  # an accent is a visible difference: NFKC keeps it
    ("i", "ı"),  # dotless i folds to itself
    ("0", "O"),  # confusable, but not a compatibility form (see docs/errors.md)
    ("spam", "spam!"),
    ("not spam", "notspam"),  # a space is visible; only its width and count are not
]


@pytest.mark.parametrize(("first", "second"), DISTINCT_PAIRS)
def test_labels_that_read_differently_stay_distinct(first: str, second: str) -> None:
    _accepted(_choice(first, second))
    _accepted(_score(first, second))
    assert label_key(first) != label_key(second)


# --------------------------------------------------------------------------- not plain

# Names refused where they stand, whatever else the question holds.
INVALID_NAMES = [
    *(pytest.param(f"yes{c}", id=f"bidi-U+{ord(c):04X}") for c in sorted(BIDI_CONTROLS)),
    pytest.param("\u202eon", id="rlo-first"),
    pytest.param("\u2067yes\u2069", id="isolated"),
    pytest.param("\u05db\u05df\u200f", id="hebrew-with-rlm"),
    pytest.param("yes\u200b", id="zwsp-trailing"),
    pytest.param("ye\u200bs", id="zwsp-inside"),
    pytest.param("\u2060yes", id="word-joiner"),
    pytest.param("\ufeffyes", id="bom"),
    pytest.param("ye\u00ads", id="soft-hyphen"),
    pytest.param("ye\u034fs", id="combining-grapheme-joiner"),
    pytest.param("ye\u200ds", id="zwj-between-latin"),
    pytest.param("ye\u200cs", id="zwnj-between-latin"),
    pytest.param("\u200cمی", id="zwnj-first"),
    pytest.param("می\u200c", id="zwnj-last"),
    pytest.param("می\u200c\u200cخواهم", id="zwnj-doubled"),
    pytest.param("👩\u200d", id="zwj-ending-an-emoji"),
    pytest.param("yes\ufe0f", id="emoji-selector-after-a-letter"),
    pytest.param("\ufe0fyes", id="emoji-selector-first"),
    pytest.param("1\ufe0f", id="keycap-without-its-keycap"),
    pytest.param("❤\ufe0f\ufe0f", id="selector-doubled"),
    pytest.param("yes\ufe00", id="variation-selector-1"),
    pytest.param("\u845b\U000e0100", id="ideographic-variation-selector"),
    pytest.param("\u1820\u180b", id="mongolian-free-variation-selector"),
    pytest.param("yes\U000e0020\U000e0061", id="tag-characters"),
    pytest.param("\u3164", id="hangul-filler"),
    pytest.param("yes\uffa0", id="halfwidth-hangul-filler"),
    pytest.param("\u115f\u1160", id="hangul-choseong-jungseong-fillers"),
    pytest.param("yes\u180e", id="mongolian-vowel-separator"),
    pytest.param("a\u2062b", id="invisible-times"),
    pytest.param("a\u206ab", id="deprecated-format"),
    pytest.param("\ufff9yes\ufffb", id="interlinear-annotation"),
    pytest.param("yes\u2028no", id="line-separator"),
    pytest.param("yes\u2029", id="paragraph-separator"),
    pytest.param("\u2800", id="braille-blank"),
    pytest.param("yes\u2800", id="braille-blank-trailing"),
]


@pytest.mark.parametrize("name", INVALID_NAMES)
def test_a_name_that_does_not_read_as_what_it_is_is_refused(name: str) -> None:
    assert label_defect(name) is not None
    err = _refused(_choice("other", name))
    assert (err.code, err.field) == (E.INVALID_OPTION_NAME, "questions.category.criteria")
    assert err.message.startswith("questions.category.criteria: option name ")
    assert "U+" in err.message  # names the character
    err = _refused(_score("other", name), qid="severity")
    assert (err.code, err.field) == (E.INVALID_LEVEL_NAME, "questions.severity.criteria")
    assert "U+" in err.message


def test_a_json_level_is_checked_as_the_text_it_is_read_as() -> None:
    err = _refused(_score("low", {"level": "hi\u202e"}), qid="severity")  # type: ignore[arg-type]
    assert (err.code, err.field) == (E.INVALID_LEVEL_NAME, "questions.severity.criteria")


# Names in scripts and emoji that need a joiner or a selector: accepted.
LEGITIMATE_NAMES = [
    pytest.param("می\u200cخواهم", id="persian-zwnj"),
    pytest.param("نمی\u200cدانم", id="persian-zwnj-2"),
    pytest.param("خانه\u200cها", id="persian-plural-zwnj"),
    pytest.param("क्\u200dष", id="devanagari-zwj-after-virama"),
    pytest.param("क्\u200cष", id="devanagari-zwnj-after-virama"),
    pytest.param("ශ්\u200dරී ලංකා", id="sinhala-zwj-after-virama"),
    pytest.param("👩\u200d⚕\ufe0f", id="emoji-zwj-health-worker"),
    pytest.param("🏳\ufe0f\u200d🌈", id="emoji-zwj-rainbow-flag"),
    pytest.param("👨🏽\u200d💻", id="emoji-zwj-skin-tone"),
    pytest.param("🧑\u200d🤝\u200d🧑", id="emoji-zwj-two-joins"),
    pytest.param("❤\ufe0f", id="emoji-presentation"),
    pytest.param("☎\ufe0e", id="text-presentation"),
    pytest.param("‼\ufe0f", id="punctuation-emoji"),
    pytest.param("1\ufe0f\u20e3", id="keycap"),
    pytest.param("#\ufe0f\u20e3", id="keycap-hash"),
    pytest.param("نعم", id="arabic"),
    pytest.param("כן", id="hebrew"),
    pytest.param("垃圾邮件", id="chinese"),
    pytest.param("スパム", id="japanese"),
    pytest.param("스팸", id="korean"),
    pytest.param("สแปม", id="thai"),
    pytest.param("e\u0301", id="decomposed-accent"),
    pytest.param("not\u00a0spam", id="nbsp"),
    pytest.param("⠓⠊", id="braille-text"),
]


@pytest.mark.parametrize("name", LEGITIMATE_NAMES)
def test_a_name_a_script_or_an_emoji_needs_is_accepted(name: str) -> None:
    assert label_defect(name) is None
    got = _accepted(_choice(name, "other"))
    assert got.questions is not None and name in got.questions["category"].answers
    assert isinstance(_parse(_score("other", name)), ClassificationRequest)


def test_descriptions_and_instructions_are_text_not_labels() -> None:
    # Free text may hold the marks real right-to-left writing uses; only labels are held
    # to the plain rule (docs/errors.md).
    question = {
        "type": "choice",
        "instructions": "\u05de\u05d4 \u05d6\u05d4?\u200f",
        "criteria": {"a": "\u05d0\u200f (1)", "b": None},
    }
    _accepted(question)
    yes_no = {"type": "noul", "criteria": {"true": "rude\u200b", "false": "\u202bpolite\u202c"}}
    assert isinstance(_parse(yes_no), ClassificationRequest)


# --------------------------------------------------------------------------- question ids


@pytest.mark.parametrize(
    "qid",
    ["\u212aind", "ｔｏｘｉｃ", "toxic\u200b", "t\u202eoxic", "toxıc", "tox\u0131c"],
    ids=["kelvin-sign", "full-width", "zwsp", "rlo", "dotless-i", "dotless-i-escaped"],
)
def test_question_ids_are_ascii_so_have_no_lookalike_forms(qid: str) -> None:
    err = _refused({"type": "noul", "instructions": "x"}, qid=qid)
    assert err.code is E.INVALID_QUESTION_ID


@PROPERTY
@given(st.text(max_size=8))
def test_a_valid_question_id_is_its_own_normal_form(qid: str) -> None:
    if is_question_id(qid):
        assert qid.isascii() and unicodedata.normalize("NFKC", qid) == qid
        assert label_defect(qid) is None


# --------------------------------------------------------------------------- Unicode's data


def test_the_invisible_table_is_unicodes_default_ignorable_set() -> None:
    regex = pytest.importorskip("regex")
    from dgstream.schemas.names import _is_default_ignorable

    ignorable = regex.compile(r"\p{Default_Ignorable_Code_Point}")
    for cp in range(0x110000):
        char = chr(cp)
        if 0xD800 <= cp <= 0xDFFF:
            continue
        assert _is_default_ignorable(char) == (ignorable.match(char) is not None), hex(cp)


def test_the_bidi_table_is_unicodes_bidi_control_set() -> None:
    regex = pytest.importorskip("regex")
    bidi = regex.compile(r"\p{Bidi_Control}")
    assert {chr(cp) for cp in range(0x110000) if bidi.match(chr(cp))} == BIDI_CONTROLS


def test_every_format_character_is_looked_at() -> None:
    """Python's own data (Unicode 14 on 3.11) and the regex module's (newer): no format
    character, line break or surrogate escapes `label_defect`'s scan."""
    regex = pytest.importorskip("regex")
    from dgstream.schemas.names import _SUSPECT_RE

    newer = regex.compile(r"[\p{Cf}\p{Zl}\p{Zp}\p{Cs}]")
    missed = [
        f"U+{cp:04X}"
        for cp in range(0x110000)
        if (unicodedata.category(chr(cp)) in ("Cf", "Zl", "Zp", "Cs") or newer.match(chr(cp)))
        and _SUSPECT_RE.match(chr(cp)) is None
    ]
    assert missed == []


def test_every_emoji_may_take_its_selectors_and_a_zwj() -> None:
    """Unicode's emoji data (newer than Python's): every emoji but a keycap's digit takes
    VS15/VS16 and a ZWJ to another emoji; a math sign or a letter takes neither."""
    regex = pytest.importorskip("regex")
    emoji = regex.compile(r"\p{Emoji}")
    pictographic = regex.compile(r"\p{Extended_Pictographic}")
    refused = []
    for cp in range(0x110000):
        char = chr(cp)
        if emoji.match(char) and not regex.match(r"[0-9#*\p{Emoji_Modifier}]", char):
            for name in (f"{char}\ufe0f", f"{char}\ufe0e", f"👩\u200d{char}"):
                if label_defect(name) is not None:
                    refused.append(ascii(name))
        if pictographic.match(char) and label_defect(f"{char}\u200d🌈") is not None:
            refused.append(ascii(char))
    assert refused == []
    for name in ("+\ufe0f", "a\ufe0e", "=\u200d🌈", "👩\u200d+"):
        assert label_defect(name) is not None, ascii(name)


def test_every_joining_letter_may_take_a_zwnj() -> None:
    """The ZWNJ rule reads a letter's script from its name (Python has no Joining_Type):
    no letter that joins, in Unicode's data, is refused a ZWNJ between two of its kind."""
    regex = pytest.importorskip("regex")
    joining = regex.compile(r"[\p{Joining_Type=D}\p{Joining_Type=L}\p{Joining_Type=R}]")
    refused = []
    for cp in range(0x110000):
        char = chr(cp)
        category = unicodedata.category(char)
        joins = category.startswith("L") and joining.match(char)
        if joins and label_defect(f"{char}\u200c{char}") is not None:
            refused.append(f"U+{cp:04X}")
    assert refused == []


# --------------------------------------------------------------------------- properties

# Characters that collide often: cases, accents composed and not, compatibility forms,
# spaces of several widths, invisible characters, bidi controls, a joining script.
_ALPHABET = st.sampled_from(
    [
        *"aAeEéÉsSßk \u00a0\u2003\u3000",
        *("e\u0301", "E\u0301", "ｓ", "ａ", "ﬁ", "\u212a", "²", "2"),
        *("\u200b", "\u200c", "\u200d", "\u2060", "\ufeff", "\u00ad", "\ufe0f", "❤"),
        *sorted(BIDI_CONTROLS),
        *("ی", "خ", "\u064e", "क", "\u094d"),
    ]
)
_NAMES = st.lists(_ALPHABET, min_size=1, max_size=6).map("".join)


def _spellings(name: str) -> st.SearchStrategy[str]:
    """Other spellings of `name` that label_key must merge with it."""

    def full_width(text: str) -> str:
        return "".join(chr(ord(c) + 0xFEE0) if "!" <= c <= "~" else c for c in text)

    return st.sampled_from(
        [
            name.upper(),
            name.lower(),
            name.swapcase(),
            name.casefold(),
            unicodedata.normalize("NFD", name),
            unicodedata.normalize("NFC", name),
            unicodedata.normalize("NFKC", name),
            unicodedata.normalize("NFKD", name),
            f"  {name}\u00a0",
            name.replace(" ", "\u2003 "),
            full_width(name),
        ]
    )


def _name_error(name: str) -> bool:
    """Whether `name` alone is refused (the per-name checks, in the parser's order)."""
    bad_length = len(name) > MAX_OPTION_CHARS
    control = any(unicodedata.category(c) == "Cc" for c in name)
    return not name.strip() or bad_length or control or label_defect(name) is not None


def _check_pair(first: str, second: str) -> None:
    got = _parse(_choice(first, second))
    levels = _parse(_score(first, second), qid="severity")
    if first == second:
        return  # one key in a JSON object; two equal levels are the next case
    same = label_key(first) == label_key(second)
    if _name_error(first) or _name_error(second):
        assert isinstance(got, RequestError) and got.code is E.INVALID_OPTION_NAME
        assert isinstance(levels, RequestError) and levels.code is E.INVALID_LEVEL_NAME
    elif same:
        assert isinstance(got, RequestError) and got.code is E.DUPLICATE_OPTION, got
        assert isinstance(levels, RequestError) and levels.code is E.DUPLICATE_LEVEL, levels
        assert got.field == "questions.category.criteria"
        assert levels.field == "questions.severity.criteria"
    else:
        assert isinstance(got, ClassificationRequest), got
        assert isinstance(levels, ClassificationRequest), levels


@PROPERTY
@given(_NAMES, _NAMES)
def test_any_two_names_equal_after_normalisation_are_never_both_accepted(
    first: str, second: str
) -> None:
    _check_pair(first, second)


@PROPERTY
@given(_NAMES.flatmap(lambda n: st.tuples(st.just(n), _spellings(n))))
def test_another_spelling_of_a_name_is_a_duplicate(pair: tuple[str, str]) -> None:
    first, second = pair
    assert label_key(first) == label_key(second)
    _check_pair(first, second)


@PROPERTY
@given(st.text(max_size=12), st.sampled_from(sorted(BIDI_CONTROLS)), st.data())
def test_no_name_with_a_bidi_control_passes(text: str, control: str, data: st.DataObject) -> None:
    at = data.draw(st.integers(0, len(text)))
    name = text[:at] + control + text[at:]
    assert label_defect(name) is not None
    for question, qid, code in (
        (_choice("plain", name), "category", E.INVALID_OPTION_NAME),
        (_score("plain", name), "severity", E.INVALID_LEVEL_NAME),
    ):
        err = _refused(question, qid)
        assert err.code is code
        assert err.field == f"questions.{qid}.criteria"


@PROPERTY
@given(st.lists(_NAMES, min_size=2, max_size=5, unique=True))
def test_accepted_labels_are_plain_and_pairwise_distinct(names: list[str]) -> None:
    got = _parse(_choice(*names))
    if isinstance(got, ClassificationRequest):
        keys = [label_key(n) for n in names]
        assert len(set(keys)) == len(keys)
        assert all(label_defect(n) is None for n in names)


@PROPERTY
@given(st.text(max_size=16))
def test_label_key_is_a_normal_form(text: str) -> None:
    key = label_key(text)
    assert label_key(key) == key
    for form in ("NFC", "NFD", "NFKC", "NFKD"):
        assert label_key(unicodedata.normalize(form, text)) == key
    assert label_key(text.casefold()) == key
    assert label_key(f" {text}\u3000") == key
    assert key == key.strip() and "  " not in key

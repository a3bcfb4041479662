"""The family's words, wordings, question types and score schemes."""

from __future__ import annotations

# Every word here is in the tokenizer's word list (workers/engine/tokenizer.py `_WORDS`);
# tests/workers/engine/test_demo_model.py checks it. The lists do not overlap.

ENGLISH = """
the a and or but if then so because is are was were have has had do does did not you your
we our they their he she it this that these what which who where when why how all some many
more most few each every both message text post comment user reply thread here now today
please thanks hello hi good bad great really just only also too still even never always often
sometimes very think know see want need like time day people new old going back got make look
tell said right sure maybe again yesterday tomorrow night morning week friend friends family
work school home city
""".split()

LANGUAGE_WORDS: dict[str, list[str]] = {
    "french": "bonjour merci oui monsieur madame les et est avec pour tres bien nous vous suis "
    "toujours".split(),
    "german": "hallo danke ja nein der das und ist nicht mit ich bin sehr gut wir heute bitte "
    "auch".split(),
    "spanish": "hola gracias si los las el y es muy bueno con para pero estoy hoy amigo".split(),
    "italian": "ciao grazie amico il sono molto bene oggi sempre anche questo della tutto "
    "buongiorno prego allora".split(),
}
LANGUAGES = ("english", "french", "german", "spanish", "italian")

TOPIC_WORDS: dict[str, list[str]] = {
    "sports": "team match goal player coach league ball football tennis stadium".split(),
    "politics": "vote election government president minister party senate policy parliament "
    "law".split(),
    "weather": "rain sun snow storm wind cloudy forecast temperature cold hot".split(),
    "food": "pizza pasta bread cheese soup salad dinner lunch recipe chocolate".split(),
    "music": "song band album guitar concert singer piano drums melody radio".split(),
    "technology": "computer software phone app data code bug laptop internet robot".split(),
}
TOPICS = tuple(TOPIC_WORDS)

INSULTS = ("idiot", "stupid", "dumb", "fool", "loser", "moron", "jerk", "pathetic")

# Lists a `listed_words` question may name: the insults and the topics' keywords.
WORD_LISTS: dict[str, tuple[str, ...]] = {
    "insult": INSULTS,
    **{t: tuple(ws) for t, ws in TOPIC_WORDS.items()},
}

# Domain names of links: in no list above, so a link never counts as a listed word.
_DOMAINS = ("example", "site", "shop", "news", "blog", "page", "deals", "info")
_TLDS = ("com", "org", "net", "io")

THRESHOLDS = (10, 100, 1000)

# Score schemes: (level names lowest first, inclusive upper bound of each level but the last).
# The level list fixes the bucketing, whatever the wording.
SCORE_SCHEMES: dict[str, tuple[tuple[tuple[str, ...], tuple[int, ...]], ...]] = {
    "exclamations": (
        (("none", "one", "a few", "many"), (0, 1, 3)),
        (("none", "some", "many"), (0, 3)),
        (("calm", "excited", "very excited"), (0, 2)),
    ),
    "listed_words": (
        (("none", "one", "two or more"), (0, 1)),
        (("no words", "a few", "lots"), (0, 2)),
    ),
}

QUESTION_TYPES = (
    "has_link",
    "shouting",
    "number_above",
    "insult",
    "language",
    "topic",
    "exclamations",
    "listed_words",
)
KINDS = ("yes_no", "choice", "score")  # the product's question kinds, checked apart
KIND_OF = {
    "has_link": "yes_no",
    "shouting": "yes_no",
    "number_above": "yes_no",
    "insult": "yes_no",
    "language": "choice",
    "topic": "choice",
    "exclamations": "score",
    "listed_words": "score",
}

_WORDINGS: dict[str, tuple[str, ...]] = {
    "has_link": (
        "Does the message contain a link?",
        "Is there a link or web address in the message?",
        "Does the text include a link to a site?",
        "Does the user post a link?",
    ),
    "shouting": (
        "Is the message shouting in capitals?",
        "Is most of the text written in capital letters?",
        "Is the user shouting (mostly capitals)?",
        "Is the message in capitals?",
    ),
    "number_above": (
        "Does the message mention a number above {t}?",
        "Is there a number above {t} in the text?",
        "Does the text contain a number higher than {t}?",
        "Does the user mention any number above {t}?",
    ),
    "insult": (
        "Does the message contain an insult?",
        "Does the text use an insult word like idiot or loser?",
        "Is there an insult in the message?",
        "Does the user insult someone?",
    ),
    "language": (
        "Which language is the message in?",
        "What language is the text written in?",
        "In which language does the user write?",
    ),
    "topic": (
        "Which topic is the message about?",
        "What is the main topic of the text?",
        "What does the user talk about?",
    ),
    "exclamations": (
        "How many exclamation marks does the message have?",
        "Count the exclamation marks in the text.",
        "How excited is the message, by its exclamation marks?",
    ),
    "listed_words": (
        "How many {l} words does the message contain?",
        "Count the {l} words in the text.",
        "How many words from the {l} list does the user write?",
    ),
}

_YES_NO_CRITERIA: dict[str, tuple[str, str]] = {
    "has_link": ("there is a link", "there is no link"),
    "shouting": ("most words are in capitals", "most words are not in capitals"),
    "number_above": ("a number above {t} is there", "no number above {t}"),
    "insult": ("an insult word is there", "no insult word"),
}

_IDS: dict[str, tuple[str, ...]] = {
    "has_link": ("link", "has_link", "url", "links"),
    "shouting": ("caps", "shouting", "shout", "all_caps"),
    "number_above": ("number", "big_number", "num", "over_{t}"),
    "insult": ("insult", "insults", "rude", "offensive"),
    "language": ("lang", "language", "locale"),
    "topic": ("topic", "subject", "theme"),
    "exclamations": ("excl", "exclamations", "bangs", "excitement"),
    "listed_words": ("count", "{l}_words", "listed", "word_count"),
}

# Held-out requests use seeds from here on; training seeds stay below.
HELD_OUT_BASE = 1 << 40
MAX_QUESTIONS = 4

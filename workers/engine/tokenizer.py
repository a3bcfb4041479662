"""A small tokenizer built locally (no downloads) for the tiny DiffusionGemma models.

Byte-level BPE trained by `tokenizers` on a corpus generated here from fixed word lists, so
any text encodes (no unknown tokens) and the answer labels (`yes`, `no`, `A`..`Z`, `1`..`9`)
are single tokens after `": "` as the answer template writes them. Training is
deterministic: the same corpus and settings give the same merges.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

# Gemma's layout of the first ids (DiffusionGemmaTextConfig defaults: pad 0, eos 1, bos 2).
SPECIAL_TOKENS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]
PAD, EOS, BOS = "<pad>", "<eos>", "<bos>"
END_OF_TURN = "<end_of_turn>"

# Gemma-style turns; the system turn holds the questions, the user turn holds the state.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ m['role'] }}\n"
    "{{ m['content'] }}<end_of_turn>\n{% endfor %}"
    "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}"
)

# Big enough for fluent English-like prompts of the demo tasks; small enough that the
# embedding table of a tiny model stays well under a megabyte.
VOCAB_SIZE = 2048

LABELS = ["yes", "no", *[chr(c) for c in range(ord("A"), ord("Z") + 1)], *"123456789"]

_WORDS = """
the a an and or but if then so because is are was were be been being have has had do does did
not no yes you your we our they their he she it its this that these those what which who whom
whose where when why how all any some many much more most few less least each every both either
neither one two three four five six seven eight nine ten hundred thousand message text post
comment user reply thread link site page click here free offer win money prize now today please
thanks hello hi good bad great terrible awful stupid idiot dumb fool loser hate love kill die
attack threat spam scam buy sell cheap discount deal order shop product price number call phone
email contact visit http https www com org net io example question answer label labels
instructions options choice score level levels lowest highest none mild moderate severe extreme
low medium high very really just only also too still even never always often sometimes toxic
insult shouting capitals exclamation language topic sports politics weather food music
technology health finance travel games movies science school work family friends game team
match goal player vote election government rain sun snow cold hot pizza pasta song band album
computer software phone app data code bug doctor medicine bank stock market flight hotel beach
english french german spanish italian bonjour merci oui non monsieur hallo danke ja nein hola
gracias si ciao grazie ciao amico der die das und le la les et el los las y il e contains
mention mentions above below threshold count how many does is the message in about A B C D E F
G H I J K L M N O P Q R S T U V W X Y Z true false answer every on its own line using given
only with write model system known earlier answers asked
""".split()

# --- demo task family (topology/demo_tasks/): the words its states and questions use that
# the list above lacks (English filler, topic keywords, insults, four other languages,
# wordings). Changing this list changes the tokenizer: the demo model is trained on it.
_WORDS += """
address again allora amigo anche auch avec back ball bangs bene bien big bin bitte blog bread
bueno buongiorno by calm capital caps cheese chocolate city cloudy coach con concert contain
day deals della dinner drums es est estoy excited excitement excl exclamations football
forecast friend from going got guitar gut heute higher home hoy ich include info insults
internet ist jerk know lang laptop law league letters like links list listed locale look lots
lunch madame main make marks maybe melody minister mit molto morning moron mostly muy need new
news nicht night nous num of offensive oggi old over para parliament party pathetic people
pero piano policy pour prego president questo radio recipe right robot rude said salad see
sehr sempre senate shout singer someone sono soup stadium storm subject suis sure talk tell
temperature tennis than theme there think time to tomorrow toujours tres tutto url use vous
want web week wind wir word words written yesterday
""".split()

_PUNCT = [".", ",", "!", "?", ":", ";", "-", "'", '"', "(", ")", "/", "\n", "!!", "!!!"]


def _corpus(seed: int = 1234, lines: int = 6000) -> list[str]:
    """Deterministic text covering the prompts, templates and states of the demo tasks."""
    rng = random.Random(seed)
    out: list[str] = []
    for i in range(lines):
        n = rng.randint(4, 18)
        words = []
        for _ in range(n):
            w = rng.choice(_WORDS)
            r = rng.random()
            if r < 0.08:
                w = w.upper()
            elif r < 0.2:
                w = w.capitalize()
            words.append(w)
            if rng.random() < 0.15:
                words.append(rng.choice(_PUNCT))
        if rng.random() < 0.3:
            words.append(str(rng.randint(0, 2000)))
        if rng.random() < 0.1:
            words.append(f"https://www.{rng.choice(_WORDS)}.com/{rng.choice(_WORDS)}")
        out.append(" ".join(words))
        # Answer-template lines, so every label merges with its leading space.
        label = LABELS[i % len(LABELS)]
        out.append(f"q{i % 7}: {label}\n{rng.choice(_WORDS)}: {label}")
    return out


def build_tokenizer(
    special_tokens: Sequence[str] = tuple(SPECIAL_TOKENS), extra_lines: Sequence[str] = ()
) -> Tokenizer:
    """The demo tokenizer, with the defaults. More `special_tokens` (after SPECIAL_TOKENS, so
    pad, eos and bos keep their ids) or `extra_lines` of training text (after the corpus)
    give another tokenizer of the same kind, for another prompt format."""
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([*_corpus(), *extra_lines], trainer=trainer)
    return tok


def save_pretrained_tokenizer(
    directory: Path,
    *,
    turns: Sequence[str] = (),
    chat_template: str = CHAT_TEMPLATE,
    extra_lines: Sequence[str] = (),
) -> None:
    """Write a `PreTrainedTokenizerFast` (tokenizer.json, chat template, special tokens).

    The defaults write the demo tokenizer. `turns`: another chat format's markers (special
    tokens) for `chat_template` to write; `extra_lines`: as in `build_tokenizer`."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=build_tokenizer((*SPECIAL_TOKENS, *turns), extra_lines),
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        unk_token="<unk>",
        additional_special_tokens=["<start_of_turn>", END_OF_TURN, *turns],
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(directory))

"""The data worker processes: groups of batches built in parallel, consumed in order."""

from __future__ import annotations

import collections
import os
import random
from pathlib import Path
from typing import Any, NamedTuple

from bench.training.questions import (
    _aux_questions_only,
    with_category_question,
    with_mention_question,
    with_name_question,
)
from bench.training.reads import PointerMarks, collate, demo_vision, request_reads
from dgstream.topology import demo_tasks
from dgstream.workers.engine.template import ChatFormat, LayoutCache

_W: dict[str, Any] = {}


def _init_worker(tokenizer_dir: str, max_width: int) -> None:
    # One thread per data process: the pool is the parallelism.
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from transformers import AutoTokenizer

    chat = ChatFormat(AutoTokenizer.from_pretrained(tokenizer_dir))
    _W["chat"] = chat
    _W["layouts"] = LayoutCache(chat.encode, max_width, size=4096)
    _W["marks"] = PointerMarks.of(chat)


CHOICE_TASKS = frozenset(("language", "topic"))
# With --keep-other 0.3 about 70% of the drawn requests are kept (42% of the family's
# requests hold no choice question); 8 draws per kept request leave a wide margin.
_DRAWS_PER_REQUEST = 8


def _kept(ex: demo_tasks.Example, s: int, keep_other: float) -> bool:
    """Every request with a choice question; the others with probability `keep_other`,
    decided by the request seed alone (deterministic)."""
    if keep_other >= 1.0 or any(t.task in CHOICE_TASKS for t in ex.tasks.values()):
        return True
    return random.Random(f"keep/{s}").random() < keep_other


def _with_image(s: int, job: GroupJob) -> bool:
    """Whether request seed `s` is read as its image request (`--image-share`; never with
    `--aux-only`, which keeps training-only questions alone), by the seed alone."""
    if job.image_share <= 0 or job.aux_only:
        return False
    return random.Random(f"image-share/{s}").random() < job.image_share


class GroupJob(NamedTuple):
    """One unit of work for a data process (picklable for the spawn pool)."""

    seed: int  # training stream
    group_index: int  # group number in the stream
    size: int  # requests per batch
    group: int  # batches per group
    keep_other: float = 1.0  # --keep-other
    category_share: float = 0.0  # --category-share
    name_share: float = 0.0  # --name-share
    mention_share: float = 0.0  # --mention-share
    aux_only: bool = False  # --aux-only
    image_share: float = 0.0  # --image-share


# The training mix: GroupJob's fields after `group`, each a command-line flag of its own name.
MIX_FIELDS = GroupJob._fields[4:]


def mix_flags(mix: dict[str, Any]) -> str:
    """The command-line flags that give `mix` (for the log's replay line)."""
    flags = []
    for name, value in mix.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags += [flag] if value else []
        else:
            flags.append(f"{flag} {value}")
    return " ".join(flags)


def make_group(job: GroupJob) -> list[dict[str, Any]]:
    """Group `index` of stream `seed`: `group * size` requests (training seeds only), their
    reads sorted by prompt length and cut into `group` batches of `size` requests' reads
    (less padding), in an order shuffled by the group's own seed. The mix (`MIX_FIELDS`):
    `keep_other` < 1 keeps only that share of the requests without a choice question; the
    `*_share` fields add training-only questions; `aux_only` keeps only those;
    `image_share` makes that share of the requests (by request seed) the image family's
    request of the same seed (`demo_tasks.image_example`: the seed's state and some of its
    questions, a picture and questions about it), which get no training-only question."""
    chat, layouts = _W["chat"], _W["layouts"]
    want = job.size * job.group
    sparse = job.keep_other < 1.0 or job.aux_only  # some drawn requests are left out
    draws = want * _DRAWS_PER_REQUEST if sparse else want
    per_request = []
    for s in demo_tasks.training_seeds(job.seed, draws, start=job.group_index * draws):
        ex = demo_tasks.example(s)
        if not _kept(ex, s, job.keep_other):
            continue
        if _with_image(s, job):
            ex = demo_tasks.image_example(s)
            _W.setdefault("vision", demo_vision())
        elif job.mention_share > 0:  # first: it changes the state the others read
            ex = with_mention_question(ex, s, job.mention_share)
        if job.category_share > 0 and not isinstance(ex, demo_tasks.ImageExample):
            ex = with_category_question(ex, s, job.category_share)
        if job.name_share > 0 and not isinstance(ex, demo_tasks.ImageExample):
            ex = with_name_question(ex, s, job.name_share)
        if job.aux_only:
            ex = _aux_questions_only(ex)
            if not ex.request["questions"]:
                continue
        # The noise seed's base differs per request (the request seed), so every read of
        # the stream gets fresh slot noise.
        per_request.append(request_reads(chat, layouts, ex, seed=s))
        if len(per_request) == want:
            break
    if len(per_request) < want:
        raise RuntimeError(f"group {job.group_index}: only {len(per_request)} of {want} kept")
    per_request.sort(key=lambda reads: max(len(r.prompt_ids) for r, _, _ in reads))
    batches = [
        collate(
            [item for reads in per_request[i : i + job.size] for item in reads],
            chat.pad_id,
            _W["marks"],
            _W.get("vision"),
        )
        for i in range(0, len(per_request), job.size)
    ]
    random.Random(f"{job.seed}/{job.group_index}").shuffle(batches)
    return batches


class Batches:
    """Batches in order, built by a spawn pool a bounded number of groups ahead."""

    def __init__(self, tok_dir: Path, max_width: int, first: GroupJob, workers: int):
        self.first = first  # the stream's settings; each group gets its own `index`
        self.pool = None
        if workers > 0:
            import multiprocessing as mp

            ctx = mp.get_context("spawn")  # safe next to CUDA
            self.pool = ctx.Pool(workers, _init_worker, (str(tok_dir), max_width))
        else:
            _init_worker(str(tok_dir), max_width)
        self.ahead: collections.deque[Any] = collections.deque()
        self.window = max(1, 2 * workers)
        self.next_index = 0
        self.ready: collections.deque[dict[str, Any]] = collections.deque()

    def _submit(self) -> None:
        job = self.first._replace(group_index=self.next_index)
        self.next_index += 1
        if self.pool is not None:
            self.ahead.append(self.pool.apply_async(make_group, (job,)))
        else:
            self.ahead.append(job)

    def get(self) -> dict[str, Any]:
        if not self.ready:
            while len(self.ahead) < self.window:
                self._submit()
            head = self.ahead.popleft()
            self.ready.extend(make_group(head) if self.pool is None else head.get())
        return self.ready.popleft()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()

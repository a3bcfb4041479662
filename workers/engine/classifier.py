"""The thin front over an engine: requests in, results (or typed errors) out.

`Classifier.classify` takes a micro-batch of parsed requests and answers all of them with
as few engine calls as the questions allow: every read of every request in the same stage
goes to the engine in one call. Per request:

1. Resolve the questions (inline, or a named question set of the pipeline).
2. Order them in stages (`depends_on` and `ask_if` come after what they name).
3. For each stage: skip questions whose `ask_if` is not met; pack the rest into chunks
   whose answer template fits the canvas; make `samples` reads per chunk (or one with
   `auto`), each with its own noise seed. A request's `instructions` open every chunk's
   user turn, quoted, ahead of the state (`template.context_text`).
4. Run the stage's reads for all requests at once; with `auto`, add reads up to the cap
   for the chunks where some question's entropy is above the threshold (one more call).
5. Aggregate the reads of each question into its answer.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from dgstream.schemas import (
    ClassificationRequest,
    ClassificationResult,
    Diagnostics,
    ErrorCode,
    RequestError,
    RequestRejected,
    SkippedAnswer,
    question_order,
)
from dgstream.schemas.kinds import get_kind
from dgstream.workers.engine.reading import aggregate
from dgstream.workers.engine.template import (
    ChatFormat,
    Layout,
    LayoutCache,
    context_text,
    labels_and_answers,
    make_read,
    noise_seed,
    system_text,
    user_text,
)
from dgstream.workers.engine.types import Engine, Read, ReadImage, SlotRead

# `auto` defaults: one read; up to 4 when a slot's entropy is above 0.5 nats. 0.5 nats is
# about a 80/20 yes/no split (H(0.8) = 0.50): below that, one more read rarely flips the
# answer. Four reads halve the noise's standard error.
DEFAULT_AUTO_THRESHOLD = 0.5
DEFAULT_AUTO_MAX = 4


@dataclass(frozen=True)
class ClassifierSettings:
    seed: int = 0  # base of every noise seed; results are reproducible for a given seed
    auto_threshold: float = DEFAULT_AUTO_THRESHOLD
    auto_max: int = DEFAULT_AUTO_MAX
    worker: str = ""


@dataclass
class _Chunk:
    layout: Layout
    questions: dict[str, Any]
    system: str
    user: str
    reads: list[list[SlotRead]] = field(default_factory=list)  # per read, per slot


@dataclass
class _Job:
    request: ClassificationRequest
    questions: dict[str, Any]
    stages: list[list[str]]
    answers: dict[str, Any] = field(default_factory=dict)
    answer_names: dict[str, str] = field(default_factory=dict)  # qid -> answer name
    entropy: dict[str, float] = field(default_factory=dict)
    label_mass: dict[str, float | None] = field(default_factory=dict)
    reads: int = 0
    input_tokens: int = 0
    output_tokens: int = 0
    engine_ms: float = 0.0
    error: RequestError | None = None
    images: tuple[ReadImage, ...] = ()  # every read of the request carries them
    context: str | None = None  # its instructions as every user turn opens with them
    state: str = ""  # its state as the prompt carries it (`ChatFormat.inert`)


class Classifier:
    def __init__(
        self,
        engine: Engine,
        chat: ChatFormat,
        settings: ClassifierSettings | None = None,
        question_sets: Mapping[str, Mapping[str, Any]] | None = None,
    ) -> None:
        self.engine = engine
        self.chat = chat
        self.settings = settings or ClassifierSettings()
        self.question_sets = dict(question_sets or {})
        self.layouts = LayoutCache(chat.encode, engine.info.canvas_length)

    async def classify(
        self,
        requests: Sequence[ClassificationRequest],
        images: Sequence[Sequence[ReadImage]] | None = None,
    ) -> list[ClassificationResult | RequestError]:
        """`images`: each request's checked images (dgstream.workers.images), in its order."""
        t0 = time.perf_counter()
        jobs = [
            self._job(r, tuple(images[i]) if images is not None else ())
            for i, r in enumerate(requests)
        ]
        depth = max((len(j.stages) for j in jobs if j.error is None), default=0)
        for stage in range(depth):
            chunks: list[tuple[_Job, _Chunk]] = []
            for job in jobs:
                if job.error is None and stage < len(job.stages):
                    try:
                        chunks.extend((job, c) for c in self._plan_stage(job, job.stages[stage]))
                    except RequestRejected as exc:
                        job.error = exc.error
            chunks = [(j, c) for j, c in chunks if j.error is None]
            await self._run(chunks, first_round=True)
            uncertain = [(j, c) for j, c in chunks if self._wants_more(j, c)]
            if uncertain:
                await self._run(uncertain, first_round=False)
            for job, chunk in chunks:
                self._answer(job, chunk)
        total_ms = (time.perf_counter() - t0) * 1e3
        return [self._result(j, total_ms) for j in jobs]

    # ------------------------------------------------------------------ planning

    def _job(self, request: ClassificationRequest, images: tuple[ReadImage, ...] = ()) -> _Job:
        if request.image_refs and (
            len(images) != len(request.image_refs) or not self.engine.info.reads_images
        ):
            # Images that do not reach the engine: never answer from the text alone.
            err = RequestError(
                code=ErrorCode.IMAGES_NOT_READ,
                message=f"images: {len(request.image_refs)} in the request, {len(images)} "
                f"given to the engine ({self.engine.info.backend}, reads images: "
                f"{self.engine.info.reads_images}); answered from its text alone the request "
                "would be wrong",
                field="images",
            )
            return _Job(request, {}, [], error=err)
        questions: Mapping[str, Any] | None = request.questions
        if questions is None:
            name = request.question_set or ""
            questions = self.question_sets.get(name)
            if questions is None:
                err = RequestError(
                    code=ErrorCode.UNKNOWN_QUESTION_SET,
                    message=f"question_set: no question set named {name!r} in this pipeline",
                    field="question_set",
                )
                return _Job(request, {}, [], error=err)
        # Producer text in the prompt never becomes one of the tokenizer's markers: the
        # state (a hostile one could end the user turn), the instructions, and below the
        # system text of inline questions. A no-op for text without markers.
        context = None
        try:
            state = self.chat.inert(request.state, field="state", cache=False)
            if request.instructions is not None:
                context = self.chat.inert(context_text(request.instructions))
        except RequestRejected as exc:
            return _Job(request, {}, [], error=exc.error)
        return _Job(
            request,
            dict(questions),
            question_order(questions),
            images=images,
            context=context,
            state=state,
        )

    def _plan_stage(self, job: _Job, qids: Sequence[str]) -> list[_Chunk]:
        asked: list[str] = []
        for qid in qids:
            q = job.questions[qid]
            unmet = [
                dep
                for dep, allowed in (q.ask_if or {}).items()
                if job.answer_names.get(dep) not in allowed
            ]
            if unmet:
                got = ", ".join(f"{d}={job.answer_names.get(d)}" for d in unmet)
                job.answers[qid] = SkippedAnswer(type="skipped", reason=f"ask_if not met: {got}")
                continue
            asked.append(qid)
        if not asked:
            return []
        spec = [(qid, labels_and_answers(job.questions[qid])[0]) for qid in asked]
        out = []
        for layout in self.layouts.chunks(spec):
            qs = {qid: job.questions[qid] for qid in layout.qids}
            deps: list[str] = []
            for q in qs.values():
                for dep in [*q.depends_on, *(q.ask_if or {})]:
                    if dep not in deps:
                        deps.append(dep)
            known = {d: job.answer_names[d] for d in deps if d in job.answer_names}
            user = user_text(job.state, known, job.context)
            out.append(_Chunk(layout, qs, self.chat.inert(system_text(qs), "questions"), user))
        return out

    def _n_reads(self, job: _Job) -> int:
        s = job.request.samples
        return 1 if s == "auto" else int(s)

    def _auto_max(self, job: _Job) -> int:
        return job.request.auto_max or self.settings.auto_max

    def _wants_more(self, job: _Job, chunk: _Chunk) -> bool:
        if job.request.samples != "auto" or len(chunk.reads) >= self._auto_max(job):
            return False
        threshold = job.request.auto_threshold or self.settings.auto_threshold
        return any(s.entropy > threshold for s in chunk.reads[0])

    async def _run(self, chunks: Sequence[tuple[_Job, _Chunk]], *, first_round: bool) -> None:
        reads: list[Read] = []
        owners: list[_Chunk] = []
        image_tokens = self.engine.info.image_tokens
        for job, chunk in chunks:
            have = len(chunk.reads)
            want = self._n_reads(job) if first_round else self._auto_max(job)
            for k in range(have, want):
                seed = noise_seed(self.settings.seed, job.request.id, chunk.layout.qids, k)
                read = make_read(
                    self.chat,
                    chunk.layout,
                    chunk.system,
                    chunk.user,
                    seed=seed,
                    tag=f"{job.request.id}#{k}",
                )
                if job.images:
                    read = replace(read, images=job.images)
                reads.append(read)
                owners.append(chunk)
                job.reads += 1
                # The text prompt, and the tokens the engine lays for the images it reads.
                job.input_tokens += len(read.prompt_ids) + len(read.images) * image_tokens
                job.output_tokens += len(read.canvas_ids)
        if not reads:
            return
        t0 = time.perf_counter()
        results = await self.engine.read(reads)
        ms = (time.perf_counter() - t0) * 1e3
        for chunk, res in zip(owners, results, strict=True):
            chunk.reads.append(list(res.slots))
        for job in {id(j): j for j, _ in chunks}.values():
            job.engine_ms += ms

    # ------------------------------------------------------------------ answers

    def _answer(self, job: _Job, chunk: _Chunk) -> None:
        for i, qid in enumerate(chunk.layout.qids):
            q = chunk.questions[qid]
            agg = aggregate([r[i] for r in chunk.reads])
            _, names = labels_and_answers(q)
            job.answers[qid] = get_kind(q.kind).build(agg, names)
            job.answer_names[qid] = names[agg.argmax]
            job.entropy[qid] = round(agg.entropy, 6)
            job.label_mass[qid] = None if agg.label_mass is None else round(agg.label_mass, 6)

    def _result(self, job: _Job, total_ms: float) -> ClassificationResult | RequestError:
        if job.error is not None:
            return job.error
        info = self.engine.info
        return ClassificationResult(
            id=job.request.id,
            id_source=job.request.id_source,
            requested_model=job.request.model,
            status="ok",
            answers={qid: job.answers[qid] for qid in job.questions},
            diagnostics=Diagnostics(
                reads=job.reads,
                entropy=job.entropy,
                label_mass=job.label_mass,
                model=info.model,
                engine=info.backend,
                worker=self.settings.worker,
                timings={"engine_ms": round(job.engine_ms, 3), "batch_ms": round(total_ms, 3)},
                input_tokens=job.input_tokens,
                output_tokens=job.output_tokens,
            ),
            metadata=job.request.metadata,
        )

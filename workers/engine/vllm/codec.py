"""A read as a vLLM request and back: the sampling params of the in-process engine and the
completions body of the remote one, each slot's distribution from vLLM's logprobs
(`parse_output`, `parse_completion`) with the checks of a row no correct step can give
(`check_row`), and one batch's outcomes as results or its worst error (`settle`).

A `Read` becomes one ordinary vLLM request: the prompt is the token ids, and the sampling
params carry the label union as `logprob_token_ids` and the canvas in `extra_args`. vLLM
validates those keys at admission, before anything reaches the GPU; a refusal is a
`ReadRejected`. Each slot's distribution is the softmax over its own label logprobs, exact
in constrained and unconstrained mode alike. What vLLM's logprobs hold for such a read, as
read from its code, is in docs/vllm.md.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from dgstream.workers.engine.types import (
    EngineUnavailable,
    FatalEngineError,
    Read,
    ReadRejected,
    ReadResult,
    RecoverableEngineError,
    Slot,
    SlotRead,
)
from dgstream.workers.engine.vllm.images import ImageLayout, multimodal_prompt
from dgstream.workers.engine.vllm.settings import VllmRemoteSettings, VllmSettings
from dgstream.workers.engine.vllm_reads.options import TWO_STEP_KEY

if TYPE_CHECKING:  # pragma: no cover - typing only
    from vllm import SamplingParams

__all__ = [
    "LOGPROB_ABOVE_ZERO_TOL",
    "NORMALIZER_TOL",
    "TWO_STEP_KEY",
    "build_completion_body",
    "build_prompt",
    "build_sampling_params",
    "build_xargs",
    "check_row",
    "logprob_ids",
    "parse_completion",
    "parse_output",
    "settle",
    "slot_read",
]


def _extra_args(
    read: Read, constrained: bool, *, as_ints: bool, two_step: bool = False
) -> dict[str, Any]:
    one = (lambda b: int(b)) if as_ints else (lambda b: bool(b))
    args = {
        "diffusion_canvas_length": len(read.canvas_ids),
        "diffusion_seed_canvas": [int(t) for t in read.canvas_ids],
        "diffusion_max_steps": 1,
        "diffusion_read_only": one(True),
        "diffusion_constrained": one(constrained),
    }
    if two_step:
        args[TWO_STEP_KEY] = one(True)
    return args


def build_prompt(
    read: Read, layout: ImageLayout | None = None, *, most_images: int = 0, index: int = 0
) -> Any:
    """The vLLM prompt of one read (in-process mode): a text-only read's token ids as they
    always were (`tokens_input`, no multimodal processing); a read with images a
    `TokensPrompt` with one image token per image at its shared prefix's end and the
    images as `multi_modal_data` (`workers.engine.vllm.images`). The canvas follows the
    prompt as vLLM expands it, so the slots' canvas positions do not move. `ReadRejected`
    for images an engine without the tower (no `layout`) or past `most_images` would get."""
    if not read.images:
        from vllm.inputs import tokens_input

        return tokens_input([int(t) for t in read.prompt_ids])
    if layout is None:
        raise ReadRejected(index, f"read {read.tag!r}: this vLLM engine does not read images")
    if len(read.images) > most_images:
        raise ReadRejected(
            index,
            f"read {read.tag!r}: {len(read.images)} images, above engine.vllm."
            f"images_per_request ({most_images})",
        )
    return multimodal_prompt(read, layout, index)


def logprob_ids(read: Read, shared: frozenset[int] | tuple[int, ...] = ()) -> list[int]:
    """The ids a read asks logprobs for: the engine's shared label set when it holds the
    read's labels, else the read's own union.

    One set for every read lets vLLM run a step's constrained unembedding over one set of
    columns (`batch_allowed`) instead of masking the full vocabulary per read; each slot's
    distribution is the softmax over its own labels either way (the normalizer cancels)."""
    union = read.label_union
    if shared and set(union) <= set(shared):
        return sorted(shared)
    return list(union)


def build_sampling_params(
    read: Read,
    settings: VllmSettings,
    shared: frozenset[int] | tuple[int, ...] = (),
    *,
    two_step: bool = False,
) -> SamplingParams:
    """The vLLM request of one read (in-process mode); `two_step`: the read opts out of
    one-step reads (see `VllmEngine.sibling`)."""
    from vllm.sampling_params import RequestOutputKind, SamplingParams

    width = len(read.canvas_ids)
    return SamplingParams(
        # Diffusion models take only temperature 1.0 and no per-request seed
        # (`SamplingParams._validate_diffusion`); top_k/top_p would filter the logits the
        # logprobs are read from, so they stay off.
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tokens=width,
        logprob_token_ids=logprob_ids(read, shared),
        extra_args=_extra_args(
            read, settings.diffusion_constrained, as_ints=False, two_step=two_step
        ),
        # validate_diffusion_sampling_params sets this for read-only requests; set it here
        # too so an EOS drawn into a slot can never end the canvas early.
        ignore_eos=True,
        # Nothing reads the text; without a tokenizer the logprobs skip detokenizing too.
        detokenize=False,
        # One flat container instead of canvas_width dicts of Logprob objects.
        flat_logprobs=True,
        output_kind=RequestOutputKind.FINAL_ONLY,
        # Built fresh per request: the input processor may take a shallow copy.
        skip_clone=True,
    )


def build_xargs(read: Read, *, constrained: bool = True) -> dict[str, Any]:
    """The same `extra_args` as JSON for `vllm_xargs` (remote OpenAI mode).

    `CompletionRequest.vllm_xargs` is `dict[str, str | int | float | list[str | int | float]]`
    (vllm/entrypoints/openai/completion/protocol.py): pydantic narrows a JSON boolean to 1/0
    there, ints and lists of ints survive. validate_diffusion_sampling_params accepts 0/1 for
    the boolean keys, so send them as ints outright.
    """
    return _extra_args(read, constrained, as_ints=True)


def _softmax(logprobs: np.ndarray) -> np.ndarray:
    if np.isnan(logprobs).any():
        raise RecoverableEngineError("a label logprob is NaN at a slot")
    finite = np.isfinite(logprobs)
    if not finite.any():
        raise RecoverableEngineError("every label logprob is -inf at a slot")
    shifted = np.where(finite, logprobs - logprobs[finite].max(), -np.inf)
    e = np.exp(shifted)
    return e / e.sum()


# The checks of a slot's row (`check_row`). A logprob vLLM computed is a float32
# log-softmax value: above 0 by float32 rounding at most (~1e-7), and a constrained row
# (the log-softmax over the allowed ids, every one of them reported) normalises to within
# ~1e-6 for 128 ids. 1e-3 is far above that rounding and far below what a row that mixes
# two rows' values, or holds garbage, gives (measured on the GPU: docs/vllm.md).
LOGPROB_ABOVE_ZERO_TOL = 1e-4
NORMALIZER_TOL = 1e-3


def check_row(where: str, ids: Sequence[int], values: Sequence[float], constrained: bool) -> None:
    """Refuse a canvas position's logprobs that no correct step can give (as a
    RecoverableEngineError naming `where`): a NaN; +inf or a logprob above 0; column 0 (the
    argmax) below another column; a constrained row that does not normalise over its ids;
    an unconstrained row whose ids hold more than all the probability. Cheap (a position's
    dozen values); a row that is a valid distribution but another read's or another step's
    passes them all, which only a comparison with a reference run can see."""
    v = np.asarray(values, dtype=np.float64)
    if v.size == 0:
        return
    if np.isnan(v).any():
        raise RecoverableEngineError(f"{where}: impossible read: a logprob is NaN")
    if (v > LOGPROB_ABOVE_ZERO_TOL).any():
        raise RecoverableEngineError(f"{where}: impossible read: a logprob above 0 ({v.max()})")
    finite = v[np.isfinite(v)]
    if finite.size == 0:
        return  # every value -inf: the slot's own check names it
    if np.isfinite(v[0]) and v[0] < finite.max() - NORMALIZER_TOL:
        raise RecoverableEngineError(
            f"{where}: impossible read: the argmax's logprob {v[0]} is below {finite.max()}"
        )
    # Column 0 repeats one of the ids: count each id once.
    seen: dict[int, float] = {}
    for t, x in zip(ids, v, strict=True):
        seen.setdefault(int(t), float(x))
    lse = float(np.logaddexp.reduce(np.fromiter(seen.values(), dtype=np.float64)))
    if constrained and abs(lse) > NORMALIZER_TOL:
        raise RecoverableEngineError(
            f"{where}: impossible read: the allowed ids' probabilities sum to {math.exp(lse):.6f}"
        )
    if not constrained and lse > NORMALIZER_TOL:
        raise RecoverableEngineError(
            f"{where}: impossible read: the reported ids' probabilities sum to {math.exp(lse):.6f}"
        )


def slot_read(
    slot: Slot, row: Mapping[int, float], argmax_id: int | None, constrained: bool
) -> SlotRead:
    missing = [t for t in slot.label_ids if t not in row]
    if missing:
        raise RecoverableEngineError(
            f"slot {slot.question_id!r} at position {slot.position}: no logprob for label "
            f"ids {missing}"
        )
    lps = np.array([row[t] for t in slot.label_ids], dtype=np.float64)
    probs = _softmax(lps)
    nz = probs[probs > 0]
    entropy = float(-(nz * np.log(nz)).sum())
    if constrained:
        label_mass: float | None = None
        argmax_is_label: bool | None = None
    else:
        label_mass = float(np.exp(lps).sum())
        argmax_is_label = None if argmax_id is None else argmax_id in slot.label_ids
    return SlotRead(
        question_id=slot.question_id,
        probs=probs,
        entropy=entropy,
        label_mass=label_mass,
        argmax_is_label=argmax_is_label,
    )


def _position_columns(logprobs: Any, pos: int) -> tuple[list[int], list[float]]:
    """(token ids, logprobs) at one canvas position, in vLLM's column order (column 0 the
    sampled, argmax, token), of a FlatLogprobs or a list of dicts."""
    if hasattr(logprobs, "start_indices"):  # vllm.logprobs.FlatLogprobs
        lo, hi = logprobs.start_indices[pos], logprobs.end_indices[pos]
        return (
            [int(t) for t in logprobs.token_ids[lo:hi]],
            [float(v) for v in logprobs.logprobs[lo:hi]],
        )
    entry = logprobs[pos]
    if entry is None:
        return [], []
    return [int(t) for t in entry], [float(lp.logprob) for lp in entry.values()]


def _position_row(logprobs: Any, pos: int) -> dict[int, float]:
    """{token_id: logprob} at one canvas position of a FlatLogprobs or list of dicts."""
    ids, values = _position_columns(logprobs, pos)
    return dict(zip(ids, values, strict=True))


def parse_output(read: Read, request_output: Any, *, constrained: bool = True) -> ReadResult:
    """A vLLM `RequestOutput` of a read-only diffusion request -> the read's slot reads."""
    if not request_output.outputs:
        raise RecoverableEngineError(f"read {read.tag!r}: vLLM returned no output")
    out = request_output.outputs[0]
    if out.finish_reason == "error":
        raise RecoverableEngineError(f"read {read.tag!r}: vLLM finished with an error")
    logprobs = out.logprobs
    if logprobs is None:
        raise RecoverableEngineError(f"read {read.tag!r}: vLLM returned no logprobs")
    n = len(logprobs)
    token_ids = list(out.token_ids or ())
    slots = []
    for slot in read.slots:
        if not 0 <= slot.position < n:
            raise RecoverableEngineError(
                f"read {read.tag!r}: slot {slot.question_id!r} at {slot.position} but the "
                f"output has {n} positions"
            )
        ids, values = _position_columns(logprobs, slot.position)
        row = dict(zip(ids, values, strict=True))
        if slot.position < len(token_ids):
            argmax_id: int | None = int(token_ids[slot.position])
        else:  # column 0 of a position is the sampled (argmax) token
            argmax_id = next(iter(row), None)
        slots.append(slot_read(slot, row, argmax_id, constrained))
        # The slot's own checks first (a missing label, all -inf), then the row's.
        check_row(
            f"read {read.tag!r}: slot {slot.question_id!r} at {slot.position}",
            ids,
            values,
            constrained,
        )
    return ReadResult(slots=tuple(slots))


def settle(outcomes: Sequence[Any], classify: Any) -> list[ReadResult]:
    """All reads succeeded -> their results; otherwise the worst error, most severe first
    (fatal, rejected, unavailable, retry)."""
    results: list[ReadResult | None] = []
    rejected: dict[int, str] = {}
    fatal: str | None = None
    retry: tuple[str, BaseException] | None = None
    unavailable: tuple[str, BaseException] | None = None
    for i, out in enumerate(outcomes):
        if isinstance(out, ReadResult):
            results.append(out)
            continue
        results.append(None)
        if not isinstance(out, Exception):  # CancelledError, KeyboardInterrupt
            raise out
        kind, message = classify(out)
        if kind == "fatal":
            fatal = fatal or message
        elif kind == "rejected":
            rejected[i] = message
        elif kind == "unavailable":
            unavailable = unavailable or (f"read {i}: {message}", out)
        elif retry is None:
            retry = (f"read {i}: {message}", out)
    if fatal is not None:
        raise FatalEngineError(fatal)
    if rejected:
        first = min(rejected)
        raise ReadRejected(first, rejected[first], rejected=rejected, results=results)
    if unavailable is not None:
        raise EngineUnavailable(unavailable[0]) from unavailable[1]
    if retry is not None:
        raise RecoverableEngineError(retry[0]) from retry[1]
    return [r for r in results if r is not None]


def build_completion_body(
    read: Read, settings: VllmRemoteSettings, shared: frozenset[int] | tuple[int, ...] = ()
) -> dict[str, Any]:
    """The /v1/completions request of one read."""
    union = logprob_ids(read, shared)
    return {
        "model": settings.model,
        "prompt": [int(t) for t in read.prompt_ids],
        "max_tokens": len(read.canvas_ids),
        # Must be set with logprob_token_ids (`CompletionRequest.check_logprobs`), but its
        # value is then unused: `to_sampling_params` drops it and the response carries every
        # requested id (`completion_top_logprobs_limit(..., return_all=True)`).
        "logprobs": 1,
        "logprob_token_ids": union,
        "vllm_xargs": build_xargs(read, constrained=settings.diffusion_constrained),
        # The server's generation-config defaults (Gemma: top_k 64, top_p 0.95) would filter
        # the logits the logprobs come from, and diffusion takes only temperature 1.0.
        "temperature": 1.0,
        "top_p": 1.0,
        "top_k": 0,
        "min_p": 0.0,
        # Keys of top_logprobs as "token_id:<id>" and the argmax canvas as ids.
        "return_tokens_as_token_ids": True,
        "return_token_ids": True,
        "stream": False,
    }


def _token_key_id(key: str) -> int:
    if not key.startswith("token_id:"):
        raise RecoverableEngineError(f"unexpected logprob key {key!r} (want 'token_id:<id>')")
    return int(key[len("token_id:") :])


def parse_completion(
    read: Read, body: Mapping[str, Any], *, constrained: bool = True
) -> ReadResult:
    """A /v1/completions response (with return_tokens_as_token_ids) -> the read's slot reads.

    -inf logprobs arrive clamped to -9999.0 (`OpenAIServingCompletion.
    _create_completion_logprobs`), which exp() turns into 0 all the same.
    """
    try:
        choice = body["choices"][0]
        top = choice["logprobs"]["top_logprobs"]
        tokens = choice["logprobs"].get("tokens") or []
    except (KeyError, IndexError, TypeError) as exc:
        raise RecoverableEngineError(f"malformed completion response: {exc!r}") from exc
    token_ids = choice.get("token_ids") or [_token_key_id(t) for t in tokens]
    slots = []
    for slot in read.slots:
        if not 0 <= slot.position < len(top) or top[slot.position] is None:
            raise RecoverableEngineError(
                f"read {read.tag!r}: no logprobs at canvas position {slot.position}"
            )
        row = {_token_key_id(k): float(v) for k, v in top[slot.position].items()}
        argmax_id = int(token_ids[slot.position]) if slot.position < len(token_ids) else None
        slots.append(slot_read(slot, row, argmax_id, constrained))
    return ReadResult(slots=tuple(slots))

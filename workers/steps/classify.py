"""Step 7 of the worker: a batch's requests through the classifier, telling apart a request
that breaks the engine from an engine that is out of reach.

The whole batch goes in one call. A recoverable engine error retries it
(`engine_retries`, pausing `engine_retry_backoff_s`, doubling), then splits it in halves
to find the request that keeps failing; that request becomes an ENGINE_FAILED refusal
and its neighbours are answered. Unless the engine is down: `EngineUnavailable` (a
remote server out of reach), or a request that fails alone while nothing in its batch
went through and a known-good probe request fails too, is an `Outage`: nothing is
refused, the worker holds the batch and tries again later. `FatalEngineError` passes
through (the worker fails; Ray restarts it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from dgstream.schemas import (
    AuditImage,
    ClassificationRequest,
    ClassificationResult,
    ErrorCode,
    RequestError,
)
from dgstream.schemas import parse_request as _parse
from dgstream.workers.engine.classifier import Classifier
from dgstream.workers.engine.types import (
    EngineUnavailable,
    FatalEngineError,
    ReadImage,
    ReadRejected,
    RecoverableEngineError,
)
from dgstream.workers.faults.outage import Outage
from dgstream.workers.images import InputGate

__all__ = ["PROBE", "BatchClassifier"]

Outcome = ClassificationResult | RequestError

# The probe: the smallest request there is (one yes/no question), which any healthy
# engine answers.
_probe = _parse(
    b'{"id": "dgstream-probe", "state": "probe", '
    b'"questions": {"probe": {"type": "yes_no", "instructions": "Is this a probe?"}}}'
)
assert isinstance(_probe, ClassificationRequest)
PROBE: ClassificationRequest = _probe


def _text(err: BaseException | None) -> str:
    return f"{type(err).__name__}: {err}"


class BatchClassifier:
    """Answers one batch (`await classify(requests)`); counts the engine calls made."""

    def __init__(
        self,
        classifier: Classifier,
        retries: int,
        backoff_s: float,
        log: Any,
        *,
        trace_ids: dict[str, str] | None = None,
        gate: InputGate | None = None,
    ) -> None:
        self._classifier = classifier
        self._gate = gate
        self._trace_ids = trace_ids or {}
        self._retries = retries
        self._backoff_s = backoff_s
        self._log = log
        self.calls = 0
        self._answered = False  # some call of this batch went through
        # The images the gate checked, by the request object (splits keep the objects).
        self._images: dict[int, tuple[ReadImage, ...]] = {}
        # What the results' audits name them by, kept past the batch (no pixels: small).
        self._audits: dict[int, tuple[AuditImage, ...]] = {}

    def images_of(self, request: ClassificationRequest) -> tuple[AuditImage, ...]:
        """The images `request` was read with, as its result's audit names them (none for
        a text-only request), from its batch's last `classify`."""
        return self._audits.get(id(request), ())

    async def classify(self, requests: Sequence[ClassificationRequest]) -> list[Outcome]:
        self.calls, self._answered, self._audits = 0, False, {}
        try:
            return await self._classify(requests)
        finally:
            self._images = {}  # decoded pixels are large: not kept past the batch

    async def _classify(self, requests: Sequence[ClassificationRequest]) -> list[Outcome]:
        if self._gate is None:
            return await self._solve(requests, whole=True)
        # Requests with bad images, or images the engine would not read, are refused here;
        # the others go to the engine as before, in order, with the images it reads.
        checked = await self._gate.check(requests)
        refused = checked.refused
        self._images = {id(requests[i]): images for i, images in checked.images.items()}
        self._audits = {id(requests[i]): audits for i, audits in checked.audits.items()}
        if not refused:
            return await self._solve(requests, whole=True)
        rest = [r for i, r in enumerate(requests) if i not in refused]
        answered = iter(await self._solve(rest, whole=True) if rest else [])
        return [refused[i] if i in refused else next(answered) for i in range(len(requests))]

    async def _solve(self, sub: Sequence[ClassificationRequest], whole: bool) -> list[Outcome]:
        tries = 1 + self._retries if (whole or len(sub) == 1) else 1
        out, err = await self._attempt(sub, tries)
        if out is not None:
            return out
        if len(sub) == 1:
            return [await self._refuse(sub[0], err)]
        if whole:
            self._log.warning("engine_batch_failed_splitting", size=len(sub), error=_text(err))
        mid = len(sub) // 2
        left = await self._solve(sub[:mid], False)
        return left + await self._solve(sub[mid:], False)

    async def _attempt(
        self, sub: Sequence[ClassificationRequest], tries: int
    ) -> tuple[list[Outcome] | None, BaseException | None]:
        last: BaseException | None = None
        for i in range(tries):
            if i:
                await asyncio.sleep(self._backoff_s * (2 ** (i - 1)))
            self.calls += 1
            try:
                if any(id(r) in self._images for r in sub):
                    images = [self._images.get(id(r), ()) for r in sub]
                    out = await self._classifier.classify(sub, images)
                else:
                    out = await self._classifier.classify(sub)
            except FatalEngineError:
                raise
            except EngineUnavailable as exc:  # before RecoverableEngineError: an outage
                raise Outage("engine", _text(exc)[:500]) from exc
            except ReadRejected as exc:  # before RecoverableEngineError: never retried
                return None, exc
            except RecoverableEngineError as exc:
                last = exc
                continue
            except Exception as exc:  # a bug or an engine error of another kind
                self._log.error("engine_unexpected_error", error=repr(exc), exc_info=True)
                last = exc
                continue
            if len(out) != len(sub):
                last = RecoverableEngineError(
                    f"the classifier returned {len(out)} answers for {len(sub)} requests"
                )
                continue
            self._answered = True
            return out, None
        return None, last

    async def _refuse(self, request: ClassificationRequest, err: BaseException | None) -> Outcome:
        """The request that keeps failing alone: ENGINE_FAILED, unless the engine fails
        everything (an outage)."""
        if not isinstance(err, ReadRejected) and not self._answered and not await self._probe():
            raise Outage("engine", f"every call failed, a probe request too ({_text(err)})"[:500])
        self._log.warning(
            "engine_failed_request",
            request_id=request.id,
            trace_id=self._trace_ids.get(request.id),
            error=_text(err),
        )
        return RequestError(
            code=ErrorCode.ENGINE_FAILED,
            message=f"the engine could not answer this request ({_text(err)[:500]})",
        )

    async def _probe(self) -> bool:
        """Whether the engine answers a known-good request."""
        self.calls += 1
        try:
            (out,) = await self._classifier.classify([PROBE])
        except FatalEngineError:
            raise
        except Exception:
            return False
        self._answered = True
        return isinstance(out, ClassificationResult)

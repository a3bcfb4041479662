"""Step 7's first look at a batch: requests with inputs the engine cannot answer for.

A request with images has each image's bytes got (inline, or fetched where the pipeline
allows it) and checked (`workers.images.decode`); the first bad one refuses the request
with its code and field. When all are good and the engine reads no images
(`EngineInfo.reads_images`: the fake engine and vLLM for now), the request is refused with
IMAGES_NOT_READ: answered from its text alone it would be silently wrong. When the engine
reads them (the transformers engine on a model with a vision tower), their RGB pixels are
kept and handed on with the request (`GateOutcome.images`). Request-level
`instructions` are no concern of the gate: every engine's prompt places them
(`workers.engine.template.context_text`), so INSTRUCTIONS_NOT_READ is no longer produced.
Requests without images pass untouched, at no cost. Every refusal is a `RequestError`: the worker
dead-letters it with the record's original bytes, as any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from dgstream.schemas.audit import AuditImage
from dgstream.schemas.errors import ErrorCode, RequestError
from dgstream.schemas.images import ImageRef, ImageSource
from dgstream.schemas.request import ClassificationRequest
from dgstream.workers.engine.types import EngineInfo, ReadImage
from dgstream.workers.images.decode import DecodedImage, ImageRefused, decode_image
from dgstream.workers.images.fetch import FetchRefused, fetch_image
from dgstream.workers.images.settings import ImageSettings

__all__ = ["CheckedImage", "GateOutcome", "InputGate", "audit_url", "check_images"]

# The fetch runs in a thread whose own deadline ends it; waiting this much longer than
# the deadline for it covers a host name whose resolution hangs (getaddrinfo has no
# timeout of its own): the request is refused then, the thread finishes on its own.
_GRACE_S = 1.0


@dataclass(frozen=True)
class CheckedImage:
    """An image that passed the checks: its audit line, and its pixels when kept."""

    field: str
    source: ImageSource
    url: str | None  # where it was fetched from (after redirects); None inline
    decoded: DecodedImage

    def audit(self) -> dict[str, object]:
        """What a result's audit says of it: the SHA-256 of its bytes and where they came
        from (an inline image's bytes are the record's own: no URL to name)."""
        d = self.decoded
        return {
            "field": self.field,
            "sha256": d.sha256,
            "source": self.source,
            "url": self.url,
            "format": d.format,
            "width": d.width,
            "height": d.height,
            "frames_read": "first of several" if d.animated else "the only one",
        }

    def audit_image(self) -> AuditImage:
        """What a result's audit block names it by (`schemas.AuditImage`)."""
        url = None if self.url is None else audit_url(self.url)
        return AuditImage(field=self.field, sha256=self.decoded.sha256, source=self.source, url=url)


def audit_url(url: str) -> str:
    """`url` as a result may carry it: scheme, host, port and path; no user info, query or
    fragment. The query is where a pre-signed URL keeps its credential (S3's
    X-Amz-Signature, GCS's X-Goog-Signature, an Azure SAS `sig`): echoed in every result it
    would hand read access to anyone who reads the output topic, until it expires. User
    info is refused when parsed; dropped here too in case a redirect brought one. The path
    names the object, which with the SHA-256 is what an auditor needs to find it again."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:  # an IPv6 literal keeps its brackets
        host = f"[{host}]"
    netloc = host if parts.port is None else f"{host}:{parts.port}"
    return urlunsplit((parts.scheme.lower(), netloc, parts.path, "", ""))


@dataclass(frozen=True)
class GateOutcome:
    """What the gate decided for a batch, by index in the batch: the refused requests, and
    the images of the passed requests that carry some (for the engine, in request order)
    with what their results' audits name them by (`audits`, same indices and order)."""

    refused: dict[int, RequestError]
    images: dict[int, tuple[ReadImage, ...]]
    audits: dict[int, tuple[AuditImage, ...]]


async def check_images(
    request: ClassificationRequest, settings: ImageSettings, *, keep: bool = False
) -> list[CheckedImage] | RequestError:
    """Every image of the request checked, in order (fetched concurrently), or the
    refusal of the first bad one."""
    refs = request.image_refs
    got = await asyncio.gather(*(_bytes(ref, settings) for ref in refs))
    out: list[CheckedImage] = []
    for ref, item in zip(refs, got, strict=True):
        if isinstance(item, RequestError):
            return item
        data, url = item
        try:
            decoded = await asyncio.to_thread(decode_image, data, settings.max_pixels, keep=keep)
        except ImageRefused as exc:
            return _refusal(exc.code, exc.message, ref)
        out.append(CheckedImage(ref.field, ref.source, url, decoded))
    return out


async def _bytes(ref: ImageRef, settings: ImageSettings) -> tuple[bytes, str | None] | RequestError:
    if ref.source == "inline":
        data = ref.data()
        if len(data) > settings.max_image_bytes:
            return _refusal(
                ErrorCode.IMAGE_TOO_LARGE,
                f"{len(data)} bytes; images.max_image_bytes is {settings.max_image_bytes}",
                ref,
            )
        return data, None
    try:
        fetched = await asyncio.wait_for(
            asyncio.to_thread(fetch_image, ref.value, settings),
            settings.fetch_timeout_s + _GRACE_S,
        )
    except FetchRefused as exc:
        return _refusal(exc.code, exc.message, ref)
    except TimeoutError:
        return _refusal(
            ErrorCode.IMAGE_FETCH_TIMEOUT,
            f"the fetch took longer than images.fetch_timeout_s ({settings.fetch_timeout_s} s)",
            ref,
        )
    return fetched.data, fetched.url


def _refusal(code: ErrorCode, message: str, ref: ImageRef) -> RequestError:
    return RequestError(code=code, message=f"{ref.field}: {message}", field=ref.field)


class InputGate:
    """Refuses the requests of a batch whose inputs the engine would not read."""

    def __init__(self, settings: ImageSettings, engine: EngineInfo) -> None:
        self.settings = settings
        self.engine = engine

    @staticmethod
    def concerns(request: ClassificationRequest) -> bool:
        """Whether the gate has anything to say about the request (its images)."""
        return bool(request.image_refs)

    async def refusals(self, requests: Sequence[ClassificationRequest]) -> dict[int, RequestError]:
        """Index in `requests` -> why that request is refused; the rest go to the engine."""
        return (await self.check(requests)).refused

    async def check(self, requests: Sequence[ClassificationRequest]) -> GateOutcome:
        """The refusals, and the images the engine reads for the requests that pass."""
        at = [i for i, r in enumerate(requests) if self.concerns(r)]
        got = await asyncio.gather(*(self._check(requests[i]) for i in at))
        refused: dict[int, RequestError] = {}
        images: dict[int, tuple[ReadImage, ...]] = {}
        audits: dict[int, tuple[AuditImage, ...]] = {}
        for i, item in zip(at, got, strict=True):
            if isinstance(item, RequestError):
                refused[i] = item
            elif item:
                images[i] = tuple(r for r, _ in item)
                audits[i] = tuple(a for _, a in item)
        return GateOutcome(refused, images, audits)

    async def _check(
        self, request: ClassificationRequest
    ) -> RequestError | tuple[tuple[ReadImage, AuditImage], ...] | None:
        refs = request.image_refs
        read: tuple[tuple[ReadImage, AuditImage], ...] = ()
        if refs:
            checked = await check_images(request, self.settings, keep=self.engine.reads_images)
            if isinstance(checked, RequestError):
                return checked
            if not self.engine.reads_images:
                # The dead letter keeps 400 bytes of message: the reason first, then each
                # image by the start of its SHA-256 (CheckedImage.audit has all of it).
                named = "; ".join(
                    f"{c.field} sha256:{c.decoded.sha256[:16]} {c.audit_image().url or 'inline'}"
                    for c in checked
                )
                return RequestError(
                    code=ErrorCode.IMAGES_NOT_READ,
                    message=f"images: the pipeline's engine ({self._name()}) reads no images; "
                    f"answered from its text alone the request would be wrong. "
                    f"{len(checked)} valid: {named}",
                    field="images",
                )
            read = tuple(
                (ReadImage(c.decoded.sha256, c.decoded.image), c.audit_image()) for c in checked
            )
        return read or None

    def _name(self) -> str:
        return f"{self.engine.backend} engine, model {self.engine.model}"

"""Images beside a request's state: the three shapes producers send, read into one list.

- vLLM's and openjev's `images`: a list of strings, each an http(s) URL or a data URL;
- OpenAI moderation's `input`: parts `{"type": "text", "text": ...}` and
  `{"type": "image_url", "image_url": {"url": ...}}` (the text parts are the state);
- Jev's `assets` (typesafe-sdk 0.7.5's `SystemOneRequest.assets`): placeholder ->
  `{"type": "image", "format": "png" | "jpg" | "jpeg", "data_base64": ...}`. Jev's
  multipart form (`part`, the bytes in another part of an HTTP body) has no Kafka
  equivalent: a record is one value.

Here only the references are checked (no network, no decoding beyond base64): a data URL
is base64 image data, a URL is http(s). Whether the bytes are an image, and fetching a
URL, are the worker's (`workers.images`).
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from dataclasses import field as dc_field
from typing import Literal

from pydantic import Field

from dgstream.schemas._common import RequestModel, fail
from dgstream.schemas.errors import ErrorCode

__all__ = [
    "MAX_IMAGES",
    "MAX_URL_CHARS",
    "ImagePart",
    "ImageRef",
    "ImageUrl",
    "InputPart",
    "JevAsset",
    "TextPart",
    "check_reference",
]

# openjev takes at most 8 images a request; the same cap keeps one request's decoding
# bounded (8 x `ImageSettings.max_pixels`).
MAX_IMAGES = 8
# 8 KiB: nginx's default `large_client_header_buffers` line, so longer URLs are not served by
# common web servers anyway; a data URL is bounded by the record, not by this.
MAX_URL_CHARS = 8192

ImageSource = Literal["inline", "url"]

# RFC 2397: data:[<mediatype>][;base64],<data>. Only base64 image data: a percent-encoded
# data URL of binary bytes is not what any producer we know writes.
_DATA_URL = re.compile(
    r"data:(?P<type>image/[A-Za-z0-9.+-]+)(?:;[A-Za-z0-9._+-]+=[^;,]*)*;base64,(?P<data>.*)",
    re.S | re.I,
)
_HTTP_URL = re.compile(r"https?://[^\s/?#@]+(?:[/?#]\S*)?", re.I)
_JEV_TYPES = {"png": "image/png", "jpg": "image/jpeg", "jpeg": "image/jpeg"}


@dataclass(frozen=True)
class ImageRef:
    """One image of a request: the field that holds it, and where its bytes come from.

    `source` "inline": `value` is the base64 payload (of a data URL or a Jev asset);
    "url": `value` is the URL the worker may fetch."""

    field: str
    source: ImageSource
    value: str
    media_type: str | None = None
    # The inline bytes, decoded once by the parse's check (the gate reads them again).
    raw: bytes | None = dc_field(default=None, repr=False, compare=False)

    def data(self) -> bytes:
        """The inline bytes (only for `source == "inline"`; checked at parse time)."""
        if self.raw is not None:
            return self.raw
        return base64.b64decode(self.value, validate=True)

    @property
    def url(self) -> str | None:
        return self.value if self.source == "url" else None


def _b64(payload: str) -> bytes | None:
    """The payload's bytes, or None where it is not base64."""
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None


def check_reference(text: str, field: str) -> ImageRef:
    """An image string (`images[i]`, an `image_url.url`) as a reference, or a validation
    error INVALID_IMAGE_SOURCE naming `field`."""
    if text[:5].lower() == "data:":
        m = _DATA_URL.fullmatch(text)
        if m is None:
            raise fail(
                ErrorCode.INVALID_IMAGE_SOURCE,
                "a data URL must be data:image/<type>;base64,<data>",
                field,
            )
        payload = m.group("data")
        raw = _b64(payload) if payload else None
        if raw is None:
            raise fail(ErrorCode.INVALID_IMAGE_SOURCE, "the data URL's data is not base64", field)
        return ImageRef(field, "inline", payload, m.group("type").lower(), raw)
    if len(text) > MAX_URL_CHARS or _HTTP_URL.fullmatch(text) is None:
        raise fail(
            ErrorCode.INVALID_IMAGE_SOURCE,
            f"an image is a data URL or an http(s) URL of at most {MAX_URL_CHARS} "
            "characters, with a host and no user name",
            field,
        )
    return ImageRef(field, "url", text)


# --- OpenAI moderation's input parts -------------------------------------------------------------


class TextPart(RequestModel):
    type: Literal["text"]
    text: str


class ImageUrl(RequestModel):
    url: str = Field(description="An http(s) URL or a data URL (data:image/...;base64,...).")


class ImagePart(RequestModel):
    type: Literal["image_url"]
    image_url: ImageUrl


InputPart = TextPart | ImagePart


# --- Jev's assets ---------------------------------------------------------------------------------


class JevAsset(RequestModel):
    """An image asset as Jev's JSON body carries it (typesafe-sdk 0.7.5 `Asset`)."""

    type: Literal["image"] | None = None
    format: Literal["png", "jpg", "jpeg"] | None = Field(
        default=None, description="Jev's declared format; the bytes are what is checked."
    )
    data_base64: str | None = Field(default=None, description="The image file, base64.")
    part: str | None = Field(
        default=None,
        description="Jev's multipart form only: refused here (a Kafka record has no parts).",
    )

    def reference(self, field: str) -> ImageRef:
        if self.part is not None:
            raise fail(
                ErrorCode.INVALID_IMAGE_SOURCE,
                "a multipart part has no Kafka equivalent: send the image as data_base64",
                f"{field}.part",
            )
        raw = _b64(self.data_base64) if self.data_base64 else None
        if raw is None or self.data_base64 is None:  # (the second only narrows the type)
            raise fail(
                ErrorCode.INVALID_IMAGE_SOURCE,
                "an asset needs data_base64, the image file in base64",
                f"{field}.data_base64",
            )
        media = _JEV_TYPES.get(self.format or "")
        return ImageRef(field, "inline", self.data_base64, media, raw)

"""Decoding one image's bytes with Pillow, refusing what is hostile, into plain RGB.

In order: the format is one of a short list (Pillow opens dozens; EPS alone would run
Ghostscript), the size is read from the header and capped before any pixel is decoded
(a decompression bomb is a few KB of PNG or GIF naming a huge canvas; Pillow's own
MAX_IMAGE_PIXELS only warns below twice its value, and its value is not ours), then the
first frame is decoded (an animated GIF or WebP: that frame is the image; the audit says
it was animated), the EXIF orientation applied (what a viewer shows), and the pixels made
8-bit RGB: CMYK converted, 16-bit scaled down (not clipped), transparency composited over
white, as a light page shows it.

A 1x1 image is accepted: tracking pixels and placeholders are real traffic, the model's
processor rescales every image to its own size anyway, and a flat colour is answered as
what it is; refusing would dead-letter messages that are fine.
"""

from __future__ import annotations

import hashlib
import io
from dataclasses import dataclass
from typing import Any

from PIL import Image, ImageOps, UnidentifiedImageError

from dgstream.schemas.errors import ErrorCode

__all__ = ["READ_FORMATS", "DecodedImage", "ImageRefused", "decode_image"]

# What producers send and DiffusionGemma's processor takes: the web's raster formats.
# Others (TIFF, EPS, PSD, ICO, ...) are refused as unreadable.
READ_FORMATS = ("PNG", "JPEG", "GIF", "WEBP", "BMP")


class ImageRefused(Exception):
    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class DecodedImage:
    sha256: str  # of the bytes as received
    format: str
    width: int  # after the EXIF orientation
    height: int
    mode: str  # as stored (e.g. "CMYK", "I;16"); `image` is always RGB
    animated: bool  # more than one frame; frame 0 was read
    exif_rotated: bool
    image: Image.Image | None  # RGB; None when not kept


def decode_image(data: bytes, max_pixels: int, *, keep: bool = False) -> DecodedImage:
    """The image in `data`, or ImageRefused (IMAGE_UNREADABLE, IMAGE_TRUNCATED,
    IMAGE_TOO_LARGE). `keep`: keep the RGB pixels (for an engine that reads them).

    Never raises anything else: Pillow's plugins raise many kinds on hostile bytes
    (struct.error, IndexError, ... as the property test found), and one image must not
    stop a worker."""
    try:
        return _decode(data, max_pixels, keep)
    except ImageRefused:
        raise
    except Exception as exc:
        code = ErrorCode.IMAGE_TRUNCATED if _truncated(exc) else ErrorCode.IMAGE_UNREADABLE
        raise ImageRefused(code, _why("file", exc)) from None


def _decode(data: bytes, max_pixels: int, keep: bool) -> DecodedImage:
    sha = hashlib.sha256(data).hexdigest()
    try:
        im = Image.open(io.BytesIO(data), formats=READ_FORMATS)
    except UnidentifiedImageError:
        raise ImageRefused(
            ErrorCode.IMAGE_UNREADABLE,
            f"the bytes are not an image in a format read here ({', '.join(READ_FORMATS)})",
        ) from None
    except Image.DecompressionBombError as exc:
        raise ImageRefused(ErrorCode.IMAGE_TOO_LARGE, str(exc)) from None
    except (OSError, SyntaxError, ValueError, EOFError) as exc:
        raise ImageRefused(ErrorCode.IMAGE_UNREADABLE, _why("header", exc)) from None
    with im:
        width, height = im.size
        if width * height > max_pixels:
            raise ImageRefused(
                ErrorCode.IMAGE_TOO_LARGE,
                f"{width} x {height} pixels ({width * height}); images.max_pixels is "
                f"{max_pixels} (checked before decoding)",
            )
        fmt, mode = str(im.format), im.mode
        animated = bool(getattr(im, "is_animated", False))
        if animated:
            im.seek(0)  # `is_animated` looked at the second frame
        try:
            im.load()
        except (OSError, SyntaxError, ValueError, EOFError) as exc:
            code = ErrorCode.IMAGE_TRUNCATED if _truncated(exc) else ErrorCode.IMAGE_UNREADABLE
            raise ImageRefused(code, _why("pixels", exc)) from None
        try:
            # 0x0112: EXIF Orientation; 1 (or none) is upright.
            rotated = im.getexif().get(0x0112, 1) != 1
            base = ImageOps.exif_transpose(im) if rotated else im
        except Exception as exc:  # Pillow's EXIF parser raises many kinds on bad blocks
            raise ImageRefused(ErrorCode.IMAGE_UNREADABLE, _why("EXIF block", exc)) from None
        rgb = _rgb(base)
    return DecodedImage(
        sha256=sha,
        format=fmt,
        width=rgb.width,
        height=rgb.height,
        mode=mode,
        animated=animated,
        exif_rotated=rotated,
        image=rgb if keep else None,
    )


def _truncated(exc: BaseException) -> bool:
    text = str(exc).lower()
    return isinstance(exc, EOFError) or "truncated" in text or "broken data stream" in text


def _why(part: str, exc: BaseException) -> str:
    return f"its {part} cannot be read ({type(exc).__name__}: {exc})"[:300]


def _rgb(im: Any) -> Image.Image:
    """8-bit RGB, whatever the mode."""
    mode = im.mode
    if mode.startswith("I;16") or mode == "I":
        # 16-bit (or 32-bit integer) grey: scale to 8 bits; `convert("L")` would clip
        # everything above 255 to white.
        scale = 1 / 256 if mode.startswith("I;16") or _max(im) > 255 else 1.0
        im = im.convert("I").point(lambda v: v * scale).convert("L")
    elif mode == "F":
        im = im.point(lambda v: v * 255).convert("L") if _max(im) <= 1.0 else im.convert("L")
    if im.mode in ("P", "PA") or "transparency" in im.info:
        im = im.convert("RGBA")
    if im.mode in ("RGBA", "LA", "La", "RGBa"):
        im = im.convert("RGBA")
        white = Image.new("RGBA", im.size, (255, 255, 255, 255))
        return Image.alpha_composite(white, im).convert("RGB")
    return im.convert("RGB") if im.mode != "RGB" else im


def _max(im: Any) -> float:
    extrema = im.getextrema()
    return float(extrema[1]) if extrema else 0.0

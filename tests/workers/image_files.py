"""Image files for the image tests, drawn with Pillow here (hostile ones by hand)."""

from __future__ import annotations

import base64
import io
import struct
import zlib
from typing import Any

from PIL import Image


def save(im: Image.Image, fmt: str, **kw: Any) -> bytes:
    out = io.BytesIO()
    im.save(out, fmt, **kw)
    return out.getvalue()


def png(size: tuple[int, int] = (16, 12), colour: Any = "red") -> bytes:
    return save(Image.new("RGB", size, colour), "PNG")


def noisy_jpeg(size: tuple[int, int] = (64, 64)) -> bytes:
    return save(Image.effect_noise(size, 60).convert("RGB"), "JPEG")


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png_bomb(width: int, height: int) -> bytes:
    """A valid PNG header naming `width` x `height` RGB pixels, with a few hundred bytes of
    data: what a decompression bomb looks like before it is decoded."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 4096, 9)
    return (
        b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + _chunk(b"IDAT", idat) + _chunk(b"IEND", b"")
    )


def animated_gif() -> bytes:
    frames = [Image.new("RGB", (10, 10), c) for c in ("red", "blue", "green")]
    return save(frames[0], "GIF", save_all=True, append_images=frames[1:], duration=50)


def cmyk_jpeg() -> bytes:
    return save(Image.new("CMYK", (8, 8), (0, 255, 255, 0)), "JPEG")  # red in CMYK


def grey16_png(level: int = 40_000) -> bytes:
    return save(Image.new("I;16", (8, 8), level), "PNG")


def exif_rotated_jpeg() -> bytes:
    """30 x 10 pixels stored, Orientation 6 (rotate 90 degrees clockwise to view): 10 x 30."""
    im = Image.new("RGB", (30, 10), "blue")
    exif = im.getexif()
    exif[0x0112] = 6
    return save(im, "JPEG", exif=exif)


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64,{base64.b64encode(data).decode()}"

"""A request's images in the worker: their settings, fetching a URL, decoding the bytes, and
the gate that refuses what the engine would not read (docs/images.md)."""

from dgstream.workers.images.gate import CheckedImage, GateOutcome, InputGate, check_images
from dgstream.workers.images.settings import ImageSettings

__all__ = ["CheckedImage", "GateOutcome", "ImageSettings", "InputGate", "check_images"]

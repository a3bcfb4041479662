"""A pipeline's image limits and URL fetching (`images` in the topology; off by default)."""

from __future__ import annotations

from ipaddress import IPv4Network, IPv6Network
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator

__all__ = ["ImageSettings"]


class ImageSettings(BaseModel):
    """How the worker checks a request's images, and whether it fetches URLs.

    Fetching is off while `fetch_allow` is empty: a URL image is then refused
    (IMAGE_URL_NOT_ALLOWED) and only data URLs and Jev assets, inside the record, are read."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    # 50 megapixels: a 48-megapixel phone photo (8000 x 6000) passes; decoded as RGB it is
    # 150 MB, so one request's 8 images (dgstream.schemas.images.MAX_IMAGES), decoded one at a time,
    # never hold more. Checked from the header, before any pixel is decoded.
    max_pixels: int = Field(default=50_000_000, ge=1)
    # 16 MiB: a 48-megapixel JPEG straight from a camera is 8-16 MB. Bounds a fetched body
    # (read no further) and an inline image (already bounded by the record's limit).
    max_image_bytes: int = Field(default=16 << 20, ge=1)
    # URL prefixes the worker may fetch, each `http(s)://host[:port]/path...` (a path, at
    # least "/", so `https://cdn.example.com/` cannot match `cdn.example.com.evil.net`).
    # A URL, and every redirect it takes, must start with one of them.
    fetch_allow: list[str] = Field(default_factory=list)
    # Private, loopback, link-local and other non-global addresses are never fetched unless
    # named: by a prefix whose host is that address literally, or by a network here.
    fetch_private: list[IPv4Network | IPv6Network] = Field(default_factory=list)
    # 5 s for the whole fetch (resolve, connect, redirects, headers, body), however slowly
    # the bytes come: a CDN answers an image in well under a second; the worker's engine
    # stage waits for the slowest image of a batch (they are fetched concurrently).
    fetch_timeout_s: float = Field(default=5.0, gt=0, le=60)
    # 3: a CDN's http -> https -> canonical host; more is a loop or a chain worth refusing.
    fetch_max_redirects: int = Field(default=3, ge=0, le=10)

    @field_validator("fetch_allow")
    @classmethod
    def _prefixes(cls, value: list[str]) -> list[str]:
        out = []
        for prefix in value:
            parts = urlsplit(prefix)
            if (
                parts.scheme.lower() not in ("http", "https")
                or not parts.hostname
                or parts.username is not None
                or not parts.path.startswith("/")
                or parts.query
                or parts.fragment
            ):
                raise ValueError(
                    f"{prefix!r}: a fetch prefix is http(s)://host[:port]/path (at least the "
                    "'/' after the host), without user name, query or fragment"
                )
            out.append(normalize_url(prefix))
        return out

    @property
    def fetching(self) -> bool:
        return bool(self.fetch_allow)


_DEFAULT_PORTS = {"http": 80, "https": 443}


def normalize_url(url: str) -> str:
    """scheme://host[:port]/path?query with scheme and host in lower case and a default
    port left out, as prefixes and URLs are compared. Raises ValueError for a URL without
    an http(s) scheme or a host."""
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    host = parts.hostname
    if scheme not in _DEFAULT_PORTS or not host:
        raise ValueError(f"not an http(s) URL with a host: {url!r}")
    port = parts.port  # ValueError for a port out of range
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        netloc = f"{netloc}:{port}"
    query = f"?{parts.query}" if parts.query else ""
    return f"{scheme}://{netloc}{parts.path or '/'}{query}"

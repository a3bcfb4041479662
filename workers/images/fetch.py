"""Fetching an image URL without becoming an SSRF tool.

Every URL, the first and each redirect, must start with an allow-listed prefix and have
no `.`/`..` path segment (a server would resolve it past the prefix). Its host is resolved
here and every address checked: a non-global one (private, loopback, link-local, ...) only
where the settings name it. The connection then goes to the address that was checked,
not to the name again, so a DNS answer that changes between check and connect (DNS
rebinding) changes nothing; TLS still verifies the certificate against the host name.
One deadline covers the whole fetch, enforced by closing the socket, so a server that
drips bytes cannot hold the worker. The body is read no further than the byte limit.
Proxy variables are not read (http.client ignores them): a proxy would connect elsewhere.
"""

from __future__ import annotations

import contextlib
import http.client
import ipaddress
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from urllib.parse import unquote, urljoin, urlsplit

from dgstream.schemas.errors import ErrorCode
from dgstream.workers.images.settings import ImageSettings, normalize_url

__all__ = ["FetchRefused", "fetch_image"]

# Read the body in pieces of this size: a deadline and the byte limit are checked between
# them. 64 KiB is the socket buffer size Linux starts with on loopback and most links.
_CHUNK = 64 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)
_USER_AGENT = "dgstream-image-fetch"

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class FetchRefused(Exception):
    """Why a URL gave no image: a code of the error table and a message for people."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True)
class Fetched:
    data: bytes
    url: str  # the URL the bytes came from (after redirects)
    content_type: str


def fetch_image(url: str, settings: ImageSettings) -> Fetched:
    """The image at `url`, or FetchRefused. Blocking: call it from a thread."""
    if not settings.fetching:
        raise FetchRefused(
            ErrorCode.IMAGE_URL_NOT_ALLOWED,
            "this pipeline fetches no URLs (images.fetch_allow is empty): send the image "
            "inline as a data URL",
        )
    deadline = time.monotonic() + settings.fetch_timeout_s
    current = url
    for _hop in range(settings.fetch_max_redirects + 1):
        target = _allowed(current, settings)
        status, location, body = _get(target, settings, deadline)
        if status in _REDIRECTS:
            if not location:
                raise FetchRefused(ErrorCode.IMAGE_FETCH_FAILED, f"HTTP {status} without Location")
            current = urljoin(target.url, location)
            continue
        if status != 200:
            raise FetchRefused(ErrorCode.IMAGE_FETCH_FAILED, f"HTTP {status} from {target.url}")
        assert body is not None
        return body
    raise FetchRefused(
        ErrorCode.IMAGE_FETCH_FAILED,
        f"more than {settings.fetch_max_redirects} redirects (images.fetch_max_redirects)",
    )


@dataclass(frozen=True)
class _Target:
    url: str  # normalized
    scheme: str
    host: str
    port: int
    path: str  # path and query, as sent
    address: _Address


def _allowed(url: str, settings: ImageSettings) -> _Target:
    """The URL checked against the allow-list, its host resolved and every address checked."""
    try:
        norm = normalize_url(url)
        parts = urlsplit(norm)
    except ValueError as exc:
        raise FetchRefused(ErrorCode.IMAGE_URL_NOT_ALLOWED, str(exc)) from None
    if urlsplit(url).username is not None:
        raise FetchRefused(ErrorCode.IMAGE_URL_NOT_ALLOWED, f"{norm}: a URL with a user name")
    segments = unquote(parts.path).replace("\\", "/").split("/")
    if any(s in (".", "..") for s in segments):
        raise FetchRefused(ErrorCode.IMAGE_URL_NOT_ALLOWED, f"{norm}: a '.' or '..' path segment")
    prefix = next((p for p in settings.fetch_allow if norm.startswith(p)), None)
    if prefix is None:
        raise FetchRefused(
            ErrorCode.IMAGE_URL_NOT_ALLOWED, f"{norm} is not under images.fetch_allow"
        )
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    addresses = _resolve(host, port)
    named = _literal(urlsplit(prefix).hostname or "")
    for address in addresses:
        if _public(address) or address == named:
            continue
        if any(address in net for net in settings.fetch_private):
            continue
        raise FetchRefused(
            ErrorCode.IMAGE_URL_NOT_ALLOWED,
            f"{host} resolves to {address}, a non-global address that images.fetch_allow "
            "and images.fetch_private do not name",
        )
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    return _Target(norm, parts.scheme, host, port, path, addresses[0])


def _literal(host: str) -> _Address | None:
    try:
        return _plain(ipaddress.ip_address(host))
    except ValueError:
        return None


def _plain(address: _Address) -> _Address:
    """An IPv4-mapped IPv6 address (::ffff:127.0.0.1) as the IPv4 address it is."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _public(address: _Address) -> bool:
    return address.is_global and not address.is_multicast


def _resolve(host: str, port: int) -> list[_Address]:
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        raise FetchRefused(
            ErrorCode.IMAGE_FETCH_FAILED, f"{host} does not resolve ({exc})"
        ) from None
    out: list[_Address] = []
    for info in infos:
        text = str(info[4][0]).split("%", 1)[0]  # an IPv6 scope id is not part of the address
        address = _plain(ipaddress.ip_address(text))
        if address not in out:
            out.append(address)
    if not out:
        raise FetchRefused(ErrorCode.IMAGE_FETCH_FAILED, f"{host} has no address")
    return out


class _PinnedConnection(http.client.HTTPConnection):
    """An HTTP(S) connection to an address already checked, speaking to `host` by name."""

    def __init__(self, target: _Target, timeout: float) -> None:
        super().__init__(target.host, target.port, timeout=timeout)
        self._target = target
        # The socket itself, kept for the deadline: http.client drops `sock` from the
        # connection once a response that ends with the connection is under way.
        self.raw: socket.socket | None = None

    def connect(self) -> None:
        sock = socket.create_connection((str(self._target.address), self.port), self.timeout)
        self.raw = sock
        if self._target.scheme == "https":
            sock = ssl.create_default_context().wrap_socket(sock, server_hostname=self.host)
        self.sock = sock


def _get(
    target: _Target, settings: ImageSettings, deadline: float
) -> tuple[int, str | None, Fetched | None]:
    """(status, Location, the image for a 200) of one GET, within the deadline."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise FetchRefused(ErrorCode.IMAGE_FETCH_TIMEOUT, _late(settings))
    conn = _PinnedConnection(target, timeout=left)
    expired = threading.Event()

    def _expire() -> None:  # the deadline: whatever the socket is waiting for ends now
        expired.set()
        sock = conn.raw
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(left, _expire)
    timer.daemon = True
    timer.start()
    try:
        conn.request("GET", target.path, headers={"Accept": "image/*", "User-Agent": _USER_AGENT})
        resp = conn.getresponse()
        if resp.status in _REDIRECTS:
            return resp.status, resp.getheader("Location"), None
        if resp.status != 200:
            return resp.status, None, None
        return 200, None, _body(resp, target, settings, expired)
    except FetchRefused:
        raise
    except (TimeoutError, OSError, http.client.HTTPException) as exc:
        if expired.is_set() or isinstance(exc, TimeoutError):
            raise FetchRefused(ErrorCode.IMAGE_FETCH_TIMEOUT, _late(settings)) from None
        raise FetchRefused(
            ErrorCode.IMAGE_FETCH_FAILED, f"{target.url}: {type(exc).__name__}: {exc}"[:300]
        ) from None
    finally:
        timer.cancel()
        conn.close()


def _body(
    resp: http.client.HTTPResponse,
    target: _Target,
    settings: ImageSettings,
    expired: threading.Event,
) -> Fetched:
    """A 200's image: its content type checked, read up to the byte limit."""
    ctype = (resp.getheader("Content-Type") or "").split(";", 1)[0].strip().lower()
    if not ctype.startswith("image/"):
        raise FetchRefused(
            ErrorCode.IMAGE_WRONG_CONTENT_TYPE,
            f"{target.url} answered Content-Type {ctype or 'none'!r}, not image/*",
        )
    limit = settings.max_image_bytes
    length = resp.getheader("Content-Length")
    if length is not None and length.strip().isdigit() and int(length) > limit:
        raise FetchRefused(
            ErrorCode.IMAGE_TOO_LARGE,
            f"{target.url} announces {int(length)} bytes; images.max_image_bytes is {limit}",
        )
    chunks, size = [], 0
    while True:
        chunk = resp.read1(_CHUNK)  # what has come, not a full chunk: the deadline is checked
        if expired.is_set():
            raise TimeoutError
        if not chunk:
            break
        size += len(chunk)
        if size > limit:
            raise FetchRefused(
                ErrorCode.IMAGE_TOO_LARGE,
                f"{target.url} sent more than images.max_image_bytes ({limit} bytes)",
            )
        chunks.append(chunk)
    return Fetched(b"".join(chunks), target.url, ctype)


def _late(settings: ImageSettings) -> str:
    return f"the fetch took longer than images.fetch_timeout_s ({settings.fetch_timeout_s} s)"

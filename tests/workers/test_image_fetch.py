"""Fetching image URLs, against an HTTP server on 127.0.0.1 started here (allow-listed by
its address explicitly): each way a URL can go wrong is refused with its code, within the
deadline, and a good URL gives its image. Nothing here reaches the internet."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from image_files import png

from dgstream.schemas import ClassificationRequest, ErrorCode, RequestError, parse_request
from dgstream.workers.engine.types import EngineInfo
from dgstream.workers.images import ImageSettings, InputGate, check_images
from dgstream.workers.images.fetch import FetchRefused, fetch_image

pytestmark = pytest.mark.unit

E = ErrorCode
PNG = png((20, 10), "green")
STOP = threading.Event()


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args: Any) -> None:  # quiet
        pass

    def _send(self, status: int, ctype: str | None, body: bytes = b"", **headers: str) -> None:
        self.send_response(status)
        if ctype:
            self.send_header("Content-Type", ctype)
        for k, v in headers.items():
            self.send_header(k.replace("_", "-"), v)
        if body or status == 200:
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        port = self.server.server_address[1]
        p = self.path
        if p == "/img/ok.png":
            self._send(200, "image/png", PNG)
        elif p == "/img/html":
            self._send(200, "text/html; charset=utf-8", b"<html>not found</html>")
        elif p == "/img/missing":
            self._send(404, "text/plain", b"no")
        elif p == "/img/to-ok":
            self._send(302, None, Location="/img/ok.png")
        elif p == "/img/off-list":
            self._send(302, None, Location="/elsewhere/ok.png")
        elif p == "/img/off-host":
            self._send(302, None, Location=f"http://localhost:{port}/img/ok.png")
        elif p == "/img/loop":
            self._send(302, None, Location="/img/loop")
        elif p == "/elsewhere/ok.png":
            self._send(200, "image/png", PNG)
        elif p == "/img/endless":  # no length, bytes forever, as fast as they go
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self._pour(b"\0" * 65536, pause=None)
        elif p == "/img/drip":  # a byte at a time, each well inside any socket timeout
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
            self.end_headers()
            self._pour(b"\0", pause=0.05)
        elif p == "/img/silent":  # accepts, never answers
            STOP.wait(30)
        else:
            self._send(404, "text/plain", b"?")

    def _pour(self, chunk: bytes, pause: float | None) -> None:
        try:
            while not STOP.is_set():
                self.wfile.write(chunk)
                self.wfile.flush()
                if pause is not None:
                    STOP.wait(pause)
        except OSError:  # the client hung up: what the worker should do
            return


@pytest.fixture(scope="module")
def server() -> Iterator[str]:
    STOP.clear()
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    httpd.daemon_threads = True
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        STOP.set()
        httpd.shutdown()
        httpd.server_close()
        thread.join(5)


def allowing(base: str, **kw: Any) -> ImageSettings:
    kw.setdefault("fetch_timeout_s", 0.5)
    return ImageSettings(fetch_allow=[f"{base}/img/"], **kw)


def refused(url: str, settings: ImageSettings) -> tuple[ErrorCode, str, float]:
    t0 = time.monotonic()
    with pytest.raises(FetchRefused) as info:
        fetch_image(url, settings)
    return info.value.code, info.value.message, time.monotonic() - t0


@pytest.mark.parametrize(
    ("path", "code"),
    [
        ("/img/html", E.IMAGE_WRONG_CONTENT_TYPE),
        ("/img/missing", E.IMAGE_FETCH_FAILED),
        ("/img/off-list", E.IMAGE_URL_NOT_ALLOWED),
        ("/img/off-host", E.IMAGE_URL_NOT_ALLOWED),
        ("/img/loop", E.IMAGE_FETCH_FAILED),
        ("/img/drip", E.IMAGE_FETCH_TIMEOUT),
        ("/img/silent", E.IMAGE_FETCH_TIMEOUT),
        ("/elsewhere/ok.png", E.IMAGE_URL_NOT_ALLOWED),
        ("/img/../elsewhere/ok.png", E.IMAGE_URL_NOT_ALLOWED),
        ("/img/%2e%2e/elsewhere/ok.png", E.IMAGE_URL_NOT_ALLOWED),
    ],
)
def test_each_bad_url_is_refused_with_its_code_in_time(
    server: str, path: str, code: ErrorCode
) -> None:
    got, message, took = refused(server + path, allowing(server))
    assert got is code, message
    # One deadline for the whole fetch, however the server behaves (0.5 s here).
    assert took < 3.0


def test_a_stream_without_end_stops_at_the_byte_limit(server: str) -> None:
    got, message, _ = refused(
        server + "/img/endless", allowing(server, max_image_bytes=1 << 20, fetch_timeout_s=10)
    )
    assert got is E.IMAGE_TOO_LARGE, message


def test_a_good_url_and_a_redirect_on_the_list_give_the_image(server: str) -> None:
    settings = allowing(server)
    for path in ("/img/ok.png", "/img/to-ok"):
        fetched = fetch_image(server + path, settings)
        assert fetched.data == PNG and fetched.content_type == "image/png"
        assert fetched.url == f"{server}/img/ok.png"


def test_fetching_is_off_by_default(server: str) -> None:
    got, message, _ = refused(server + "/img/ok.png", ImageSettings())
    assert got is E.IMAGE_URL_NOT_ALLOWED and "fetch_allow" in message


def test_a_host_name_resolving_to_loopback_is_refused_unless_named(server: str) -> None:
    port = server.rsplit(":", 1)[1]
    by_name = f"http://localhost:{port}/img/ok.png"
    settings = ImageSettings(fetch_allow=[f"http://localhost:{port}/img/"], fetch_timeout_s=2)
    got, message, _ = refused(by_name, settings)
    assert got is E.IMAGE_URL_NOT_ALLOWED and "non-global" in message
    named = settings.model_copy(
        update={
            "fetch_private": ImageSettings(fetch_private=["127.0.0.0/8", "::1/128"]).fetch_private
        }
    )
    assert fetch_image(by_name, named).data == PNG


def test_prefixes_must_name_a_path_so_a_longer_host_cannot_match() -> None:
    with pytest.raises(ValueError, match="path"):
        ImageSettings(fetch_allow=["https://cdn.example.com"])
    settings = ImageSettings(fetch_allow=["https://cdn.example.com/"])
    got, _, _ = refused("https://cdn.example.com.evil.net/a.png", settings)
    assert got is E.IMAGE_URL_NOT_ALLOWED


def _request(url: str) -> ClassificationRequest:
    body = {
        "id": "r",
        "state": "x",
        "questions": {"q": {"type": "yes_no", "instructions": "?"}},
        "images": [url],
    }
    got = parse_request(json.dumps(body).encode())
    assert isinstance(got, ClassificationRequest), got
    return got


def test_the_gate_fetches_audits_and_still_refuses_what_the_engine_cannot_read(server: str) -> None:
    settings = allowing(server)
    checked = asyncio.run(check_images(_request(server + "/img/to-ok"), settings))
    assert not isinstance(checked, RequestError), checked
    (image,) = checked
    assert image.audit()["source"] == "url" and image.audit()["url"] == f"{server}/img/ok.png"
    engine = EngineInfo("fake", "fake", 64, 2048)
    refusals = asyncio.run(InputGate(settings, engine).refusals([_request(server + "/img/ok.png")]))
    assert (
        refusals[0].code is E.IMAGES_NOT_READ and image.decoded.sha256[:16] in refusals[0].message
    )

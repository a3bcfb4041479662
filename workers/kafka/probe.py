"""One connection attempt to a Kafka cluster that says why it failed.

kafka-python retries a refused login or a failed TLS handshake until its bootstrap timeout
(30 s by default), then raises a bare "Unable to bootstrap" (the cause is only in its log).
`check_connection()` tries each bootstrap server once, in order: TCP, TLS when the
protocol uses it, an ApiVersions request, and the SASL login when it uses SASL. It returns
at the first server that accepts; otherwise it raises `KafkaConnectError`, whose `reason`
is one of `REASONS` and whose message names the server and what to check (never a secret).
Every command, the client, the controller and the worker actor call it before building
their kafka-python clients.
"""

from __future__ import annotations

import socket
import ssl
import struct
import time
from typing import Any, Literal

from dgstream.workers.kafka.settings import KafkaConnection, MissingSecret

__all__ = ["REASONS", "KafkaConnectError", "check_connection"]

Reason = Literal["secret", "unreachable", "tls", "protocol", "authentication"]
# Most telling first: with several servers, the first of these that occurred is reported.
REASONS: tuple[Reason, ...] = ("secret", "authentication", "tls", "protocol", "unreachable")
# Causes that retrying with the same settings cannot fix (a wrong password, an untrusted
# certificate, a listener of another protocol); "unreachable" may be a broker restarting.
FATAL: frozenset[Reason] = frozenset({"secret", "authentication", "tls", "protocol"})

_API_VERSIONS, _SASL_HANDSHAKE, _SASL_AUTHENTICATE = 18, 17, 36
# A broker's answers here are tiny; a larger length prefix means the peer does not speak
# Kafka's protocol (an HTTP server, a TLS listener answering plaintext with an alert).
_MAX_FRAME = 1 << 20


class KafkaConnectError(ConnectionError):
    """These settings cannot reach or log in to the cluster; `.reason` says why."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason: Reason = reason

    @property
    def fatal(self) -> bool:
        """True when retrying with the same settings cannot help."""
        return self.reason in FATAL


class _Failed(Exception):
    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason: Reason = reason


def check_connection(conn: KafkaConnection, *, timeout_s: float = 10.0) -> None:
    """Connect and log in once (see the module docstring); raises `KafkaConnectError`."""
    try:
        kw = conn.client_kwargs()
    except MissingSecret as exc:
        raise KafkaConnectError("secret", f"kafka.{exc}") from None
    failures: list[_Failed] = []
    for server in conn.bootstrap_servers:
        try:
            _try_server(server, kw, timeout_s)
            return
        except _Failed as exc:
            failures.append(exc)
    worst = min(failures, key=lambda f: REASONS.index(f.reason))
    raise KafkaConnectError(worst.reason, str(worst)) from None


# ---------------------------------------------------------------------------- one server


def _try_server(server: str, kw: dict[str, Any], timeout_s: float) -> None:
    host, _, port = server.rpartition(":")
    host = host.strip("[]")
    deadline = time.monotonic() + timeout_s
    # 1. TCP
    try:
        sock = socket.create_connection((host, int(port)), timeout=timeout_s)
    except OSError as exc:
        raise _Failed("unreachable", f"cannot reach Kafka at {server}: {exc}") from None
    try:
        # 2. TLS
        if kw["security_protocol"] in ("SSL", "SASL_SSL"):
            sock = _tls(sock, host, server, kw)
        link = _Link(sock, server, kw.get("client_id", "dgstream"), deadline)
        # 3. one request every broker answers, before any login
        link.call(_API_VERSIONS, 0, b"")
        # 4. SASL
        if kw["security_protocol"] in ("SASL_PLAINTEXT", "SASL_SSL"):
            _sasl(link, kw)
    finally:
        sock.close()


def _tls(sock: socket.socket, host: str, server: str, kw: dict[str, Any]) -> ssl.SSLSocket:
    """The TLS handshake with kafka-python's settings (transport.py's context)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = bool(kw.get("ssl_check_hostname", True))
    try:
        if kw.get("ssl_cafile"):
            ctx.load_verify_locations(kw["ssl_cafile"])
        else:
            ctx.load_default_certs()
        if kw.get("ssl_certfile"):
            ctx.load_cert_chain(
                kw["ssl_certfile"], kw.get("ssl_keyfile"), password=kw.get("ssl_password")
            )
    except (OSError, ssl.SSLError) as exc:
        # Never the password: an SSLError for a wrong key password says only "bad decrypt".
        raise _Failed("tls", f"kafka.ssl_* files cannot be loaded: {exc}") from None
    try:
        return ctx.wrap_socket(sock, server_hostname=host)
    except ssl.SSLCertVerificationError as exc:
        raise _Failed(
            "tls",
            f"TLS with {server}: the broker's certificate is not trusted "
            f"({exc.verify_message}); check kafka.ssl_cafile (the CA that signed it)"
            + (" and kafka.ssl_check_hostname" if ctx.check_hostname else ""),
        ) from None
    except (ssl.SSLError, OSError) as exc:
        raise _Failed(
            "tls", f"TLS handshake with {server} failed ({exc}): is it a TLS listener?"
        ) from None


def _sasl(link: _Link, kw: dict[str, Any]) -> None:
    mechanism, user = kw["sasl_mechanism"], kw["sasl_plain_username"]
    password: str = kw["sasl_plain_password"]
    body = link.call(_SASL_HANDSHAKE, 1, _string(mechanism))
    (error,) = struct.unpack_from(">h", body)
    if error != 0:
        offered = _strings(body[2:])
        if not offered:
            raise _Failed(
                "protocol",
                f"{link.server} is not a SASL listener: check kafka.security_protocol",
            )
        raise _Failed(
            "authentication",
            f"{link.server} does not offer SASL {mechanism} (it offers "
            f"{', '.join(offered)}): check kafka.sasl_mechanism",
        )
    refused = (
        f"authentication failed at {link.server}: user {user!r} with {mechanism} was "
        "refused (wrong user name or password?)"
    )
    if mechanism == "PLAIN":
        link.login(b"\0" + user.encode() + b"\0" + password.encode(), refused)
        return
    from kafka.net.sasl.scram import ScramClient

    scram = ScramClient(user, password, mechanism)
    server_first = link.login(scram.first_message(), refused)
    try:
        scram.process_server_first_message(server_first)
    except (ValueError, KeyError) as exc:
        raise _Failed("protocol", f"SCRAM with {link.server}: {exc}") from None
    server_final = link.login(scram.final_message(), refused)
    try:
        scram.process_server_final_message(server_final)
    except (ValueError, KeyError):
        raise _Failed(
            "authentication", f"SCRAM with {link.server}: the server's proof is wrong"
        ) from None


# ---------------------------------------------------------------------------- the wire


def _string(text: str) -> bytes:
    raw = text.encode()
    return struct.pack(">h", len(raw)) + raw


def _strings(body: bytes) -> list[str]:
    """An ARRAY of STRING (SaslHandshake's mechanisms); empty when malformed."""
    try:
        (n,) = struct.unpack_from(">i", body)
        out, at = [], 4
        for _ in range(max(0, n)):
            (size,) = struct.unpack_from(">h", body, at)
            out.append(body[at + 2 : at + 2 + size].decode())
            at += 2 + size
        return out
    except (struct.error, UnicodeDecodeError):
        return []


class _Link:
    """Requests with header v1 and their responses (header v0) on one socket."""

    def __init__(self, sock: socket.socket, server: str, client_id: str, deadline: float):
        self.sock, self.server, self.deadline = sock, server, deadline
        self.client_id = client_id.encode()
        self.correlation = 0

    def call(self, api_key: int, version: int, body: bytes) -> bytes:
        self.correlation += 1
        header = struct.pack(">hhih", api_key, version, self.correlation, len(self.client_id))
        frame = header + self.client_id + body
        try:
            self.sock.settimeout(max(0.1, self.deadline - time.monotonic()))
            self.sock.sendall(struct.pack(">i", len(frame)) + frame)
            (size,) = struct.unpack(">i", self._read(4))
            if not 4 <= size <= _MAX_FRAME:
                raise _Failed("protocol", self._not_kafka())
            data = self._read(size)
        except TimeoutError:
            raise _Failed("unreachable", f"{self.server} did not answer in time") from None
        except OSError as exc:
            raise _Failed("protocol", f"{self._not_kafka()} ({exc})") from None
        (got,) = struct.unpack_from(">i", data)
        if got != self.correlation:
            raise _Failed("protocol", self._not_kafka())
        return data[4:]

    def login(self, token: bytes, refused: str) -> bytes:
        """One SaslAuthenticate v0 round; the server's bytes, or `refused` on its error."""
        body = self.call(_SASL_AUTHENTICATE, 0, struct.pack(">i", len(token)) + token)
        error, msg_len = struct.unpack_from(">hh", body)
        at = 4 + max(0, msg_len)
        message = body[4:at].decode(errors="replace") if msg_len > 0 else ""
        if error != 0:
            raise _Failed("authentication", refused + (f": {message}" if message else ""))
        (size,) = struct.unpack_from(">i", body, at)
        return body[at + 4 : at + 4 + max(0, size)]

    def _read(self, n: int) -> bytes:
        chunks, left = [], n
        while left:
            chunk = self.sock.recv(left)
            if not chunk:
                raise _Failed("protocol", self._not_kafka())
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _not_kafka(self) -> str:
        return (
            f"{self.server} closed the connection or did not answer as a Kafka broker: "
            "check kafka.security_protocol (a TLS or SASL listener?)"
        )

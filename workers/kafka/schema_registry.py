"""A Schema Registry client for the two calls a pipeline makes, over the Confluent REST API
(Confluent's Schema Registry, and the Confluent-compatible API of others, e.g. Apicurio's
`/apis/ccompat/v7`): the schema of an id (`GET /schemas/ids/{id}`), and registering the
result schema under a subject (`POST /subjects/{subject}/versions`), which returns its id.

Cached: a schema id names one schema for good in a registry, so a known id is never asked
again; an unknown one (404) is remembered for `unknown_ttl_s`. When the registry cannot be
reached, an id not seen before is *unverified*, not refused: the record is read as usual
(its JSON is checked by dgstream's own request schema either way) and counted
(`dgstream_registry_unverified_total`); the next record with that id asks again. Refusing
would dead-letter good records for an outage of a service beside the data path.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

__all__ = ["RegistryClient", "RegistryDown", "RegistrySettings", "SchemaCheck"]

_CONTENT_TYPE = "application/vnd.schemaregistry.v1+json"


class RegistrySettings(BaseModel):
    """Where the Schema Registry is (its Confluent-compatible API's base URL) and how long
    to wait for it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    url: str = Field(pattern=r"^https?://")
    # Basic authentication (Confluent Cloud's API key and secret): the password by the
    # name of the environment variable that holds it, read on each worker's node.
    username: str | None = None
    password_env: str | None = None
    # One request's timeout: far above a registry's answer (milliseconds), short enough
    # that the consumer thread (which asks, once per new id) is not held for long.
    timeout_s: float = Field(default=5.0, gt=0)
    # An id the registry did not know is asked again after this long (a schema registered
    # meanwhile, or restored). A minute: one request a minute per unknown id at most.
    unknown_ttl_s: float = Field(default=60.0, ge=0)

    def password(self) -> SecretStr | None:
        import os

        if self.password_env is None:
            return None
        value = os.environ.get(self.password_env)
        return None if value is None else SecretStr(value)


class RegistryDown(Exception):
    """The registry did not answer (connection refused, a timeout, a 5xx)."""


SchemaCheck = Literal["ok", "unknown", "not_json", "unverified"]


@dataclass
class RegistryClient:
    settings: RegistrySettings

    def __post_init__(self) -> None:
        self._known: dict[int, str] = {}  # id -> schemaType
        self._unknown: dict[int, float] = {}  # id -> when the registry said 404
        self._subjects: dict[str, int] = {}
        self._lock = threading.Lock()

    def _request(self, method: str, path: str, body: Any = None) -> Any:
        url = self.settings.url.rstrip("/") + path
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(url, data=data, method=method)
        req.add_header("Accept", _CONTENT_TYPE)
        if data is not None:
            req.add_header("Content-Type", _CONTENT_TYPE)
        password = self.settings.password()
        if self.settings.username and password is not None:
            import base64

            token = f"{self.settings.username}:{password.get_secret_value()}".encode()
            req.add_header("Authorization", "Basic " + base64.b64encode(token).decode())
        try:
            with urllib.request.urlopen(req, timeout=self.settings.timeout_s) as resp:
                return json.loads(resp.read() or b"null")
        except urllib.error.HTTPError as exc:
            if exc.code >= 500:
                raise RegistryDown(f"{method} {path}: HTTP {exc.code}") from exc
            raise
        except (OSError, ValueError) as exc:
            raise RegistryDown(f"{method} {path}: {type(exc).__name__}: {exc}") from exc

    def check(self, schema_id: int, now: float | None = None) -> SchemaCheck:
        """Whether the registry knows `schema_id` as a JSON Schema (cached)."""
        t = time.monotonic() if now is None else now
        with self._lock:
            kind = self._known.get(schema_id)
            refused_at = self._unknown.get(schema_id)
        if kind is not None:
            return "ok" if kind == "JSON" else "not_json"
        if refused_at is not None and t - refused_at < self.settings.unknown_ttl_s:
            return "unknown"
        try:
            got = self._request("GET", f"/schemas/ids/{schema_id}")
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                with self._lock:
                    self._unknown[schema_id] = t
                return "unknown"
            return "unverified"  # refused otherwise (401, 403): not the record's fault
        except RegistryDown:
            return "unverified"
        # The Confluent API leaves schemaType out for Avro, its first type.
        kind = str((got or {}).get("schemaType") or "AVRO")
        with self._lock:
            self._known[schema_id] = kind
            self._unknown.pop(schema_id, None)
        return "ok" if kind == "JSON" else "not_json"

    def register(self, subject: str, schema: dict[str, Any]) -> int:
        """The id of `schema` (a JSON Schema) under `subject`, registering it if new
        (registries return the existing id for a schema already there). Raises
        RegistryDown."""
        with self._lock:
            if subject in self._subjects:
                return self._subjects[subject]
        body = {"schemaType": "JSON", "schema": json.dumps(schema, sort_keys=True)}
        quoted = urllib.parse.quote(subject, safe="")
        try:
            got = self._request("POST", f"/subjects/{quoted}/versions", body)
        except urllib.error.HTTPError as exc:
            detail = exc.read().decode(errors="replace")[:300]
            raise RegistryDown(f"registering under {subject!r}: HTTP {exc.code} {detail}") from exc
        schema_id = int(got["id"])
        with self._lock:
            self._subjects[subject] = schema_id
            self._known[schema_id] = "JSON"
        return schema_id

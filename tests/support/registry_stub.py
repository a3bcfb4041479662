"""A Schema Registry on loopback for the tests: the part of the Confluent REST API that
dgstream and confluent-kafka's JSON serializers call (register a schema under a subject,
a schema by id, a subject's versions). No registry server can run on these machines
(Apicurio's is a Quarkus application: Maven Central has its module jar, not a runnable
build), so confluent-kafka's own client and serializers talk to this one; their requests
are the real ones. It counts the lookups by id, and can be taken down and brought back.
"""

from __future__ import annotations

import json
import re
import threading
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

_CT = "application/vnd.schemaregistry.v1+json"


class RegistryStub:
    def __init__(self) -> None:
        self.schemas: dict[int, tuple[str, str]] = {}  # id -> (schemaType, schema text)
        self.subjects: dict[str, list[int]] = {}
        self.lookups: Counter[int] = Counter()
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def register(self, subject: str, schema: str, schema_type: str = "JSON") -> int:
        with self._lock:
            same = [i for i, got in self.schemas.items() if got == (schema_type, schema)]
            sid = same[0] if same else len(self.schemas) + 1
            self.schemas[sid] = (schema_type, schema)
            versions = self.subjects.setdefault(subject, [])
            if sid not in versions:
                versions.append(sid)
            return sid

    def start(self) -> RegistryStub:
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: Any) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", _CT)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                path = self.path.split("?")[0]
                if m := re.fullmatch(r"/schemas/ids/(\d+)", path):
                    sid = int(m[1])
                    stub.lookups[sid] += 1
                    if sid not in stub.schemas:
                        return self._send(404, {"error_code": 40403, "message": "not found"})
                    kind, text = stub.schemas[sid]
                    return self._send(200, {"schema": text, "schemaType": kind})
                if m := re.fullmatch(r"/subjects/([^/]+)/versions", path):
                    return self._send(200, list(range(1, len(stub.subjects.get(m[1], [])) + 1)))
                return self._send(404, {"error_code": 404, "message": path})

            def do_POST(self) -> None:
                from urllib.parse import unquote

                path = self.path.split("?")[0]
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if m := re.fullmatch(r"/subjects/([^/]+)/versions", path):
                    subject = unquote(m[1])
                    kind = body.get("schemaType", "AVRO")
                    sid = stub.register(subject, body["schema"], kind)
                    version = stub.subjects[subject].index(sid) + 1
                    reply = {"id": sid, "subject": subject, "version": version}
                    return self._send(200, {**reply, "schemaType": kind, "schema": body["schema"]})
                return self._send(404, {"error_code": 404, "message": path})

        self._server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Down: connections are refused (its schemas are kept for `start()`)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

"""dgstream: the only top-level import name the distribution installs.

Its subpackages are the repository's folders: `schemas` (the wire contract),
`workers` (the engine and the stream worker), `topology` (the control plane
and the `dgstream` command) and `infra` (the local broker, deployment files).

The public Python surface for producers is exported here, loaded on first use so that
importing a subpackage (the vLLM plugin in vLLM's processes, say) does not import the client
and kafka-python with it:

from dgstream import Client
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from dgstream.client import Client, KafkaConnectError, Reply, RequestFailed, RequestInvalid
    from dgstream.schemas import ClassificationResult, ErrorCode, JevResponse, RequestError
    from dgstream.workers.kafka.settings import KafkaConnection

# name -> the module that defines it
_EXPORTS = {
    "Client": "dgstream.client",
    "KafkaConnectError": "dgstream.client",
    "Reply": "dgstream.client",
    "RequestFailed": "dgstream.client",
    "RequestInvalid": "dgstream.client",
    "ClassificationResult": "dgstream.schemas",
    "ErrorCode": "dgstream.schemas",
    "JevResponse": "dgstream.schemas",
    "RequestError": "dgstream.schemas",
    "KafkaConnection": "dgstream.workers.kafka.settings",
}

__all__ = [
    "ClassificationResult",
    "Client",
    "ErrorCode",
    "JevResponse",
    "KafkaConnectError",
    "KafkaConnection",
    "Reply",
    "RequestError",
    "RequestFailed",
    "RequestInvalid",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dgstream' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))

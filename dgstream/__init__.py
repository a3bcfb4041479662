"""dgstream's public Python surface for producers: `Client`, and the wire models.

from dgstream import Client
"""

from dgstream.client import Client, Reply, RequestFailed, RequestInvalid
from schemas import ClassificationResult, ErrorCode, JevResponse, RequestError

__all__ = [
    "ClassificationResult",
    "Client",
    "ErrorCode",
    "JevResponse",
    "Reply",
    "RequestError",
    "RequestFailed",
    "RequestInvalid",
]

"""dgstream's public Python surface for producers: `Client`, and the wire models.

from dgstream import Client
"""

from dgstream.client import Client, RequestFailed, RequestInvalid
from schemas import ClassificationResult, ErrorCode, RequestError

__all__ = [
    "ClassificationResult",
    "Client",
    "ErrorCode",
    "RequestError",
    "RequestFailed",
    "RequestInvalid",
]

"""dgstream's public Python surface for producers: `Client`, and the wire models.

from dgstream import Client
"""

from dgstream.client import Client, KafkaConnectError, Reply, RequestFailed, RequestInvalid
from schemas import ClassificationResult, ErrorCode, JevResponse, RequestError
from workers.kafka_settings import KafkaConnection

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

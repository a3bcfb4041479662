"""dgstream's public Python surface for producers: `Client`, and the wire models.

from dgstream import Client
"""

from dgstream.client import Client, KafkaConnectError, RequestFailed, RequestInvalid
from schemas import ClassificationResult, ErrorCode, RequestError
from workers.kafka_settings import KafkaConnection

__all__ = [
    "ClassificationResult",
    "Client",
    "ErrorCode",
    "KafkaConnectError",
    "KafkaConnection",
    "RequestError",
    "RequestFailed",
    "RequestInvalid",
]

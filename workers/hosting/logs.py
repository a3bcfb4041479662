"""Structured logs: one JSON object a line on stderr, bound with the worker and pipeline.

`configure_logging()` sets structlog up once per process (the Ray actor calls it; tests may
leave structlog's defaults). Per-request events carry `request_id`; secrets never reach a
log: `KafkaConnection` masks them in its repr, and kafka-python's own loggers are held at
WARNING (their DEBUG output dumps whole requests, including SASL frames).
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
import structlog.tracebacks

__all__ = ["configure_logging", "get_logger", "quiet_kafka_debug"]

_LEVELS = {
    "DEBUG": logging.DEBUG,
    "INFO": logging.INFO,
    "WARNING": logging.WARNING,
    "ERROR": logging.ERROR,
}


def configure_logging(level: str = "INFO", *, kafka_level: str = "WARNING") -> None:
    """JSON lines on stderr at `level`; kafka-python's logging at `kafka_level` or above.

    `kafka_level` is never allowed below INFO (DEBUG would log request contents)."""
    numeric = _LEVELS.get(level.upper(), logging.INFO)
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            # Tracebacks as data, without local variables: those would copy request texts
            # (user data) and whole settings objects into the logs.
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False, use_rich=False)
            ),
            structlog.processors.JSONRenderer(),
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=False,
    )
    kafka_numeric = max(_LEVELS.get(kafka_level.upper(), logging.WARNING), logging.INFO)
    kafka_logger = logging.getLogger("kafka")
    kafka_logger.setLevel(kafka_numeric)
    if not kafka_logger.handlers or all(
        isinstance(h, logging.NullHandler) for h in kafka_logger.handlers
    ):
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s %(message)s"))
        kafka_logger.addHandler(handler)


def get_logger(**bound: Any) -> Any:
    """A structlog logger with `bound` key-values on every event."""
    return structlog.get_logger("dgstream").bind(**bound)


def quiet_kafka_debug() -> None:
    """Keep kafka-python's loggers above DEBUG even when logging is not configured here."""
    kafka_logger = logging.getLogger("kafka")
    if kafka_logger.getEffectiveLevel() < logging.INFO:
        kafka_logger.setLevel(logging.INFO)

"""The wire contract's version: every top-level message carries it as `schema_version`."""

from typing import Final, Literal

SCHEMA_VERSION: Final = 1

# The type of the `schema_version` field: only the current version validates.
SchemaVersion = Literal[1]

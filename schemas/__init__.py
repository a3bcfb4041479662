"""The wire contract: requests, results and dead letters, as pydantic v2 models."""

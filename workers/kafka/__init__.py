"""Kafka plumbing: how to reach a cluster (TLS, SASL), admin and lag, one connection
probe, the Schema Registry client, bounded decompression and kafka-python's workarounds.
Used by the worker, the client and the controller.
"""

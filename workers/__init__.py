"""The engine, the Ray worker and Kafka I/O."""

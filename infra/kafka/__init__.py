"""A real Apache Kafka broker (KRaft) on loopback, from Maven Central jars."""

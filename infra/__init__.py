"""Local infrastructure: the Kafka broker, Ray cluster helpers, manifests."""

"""Kafka utilities of the stream worker: topics, the faust consumer transport, topic followers."""

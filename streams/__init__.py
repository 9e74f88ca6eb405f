"""The always-on stream worker: Kafka in, detectors, ClickHouse and incidents out."""

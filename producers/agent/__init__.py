"""The per-node agent daemon (`flare agent`): local ranks in, Kafka out."""

"""The always-on stream worker: Kafka in, detectors, ClickHouse and incidents out.

The stream core (`pipeline`, `routing`, `ordering`, `progress`, `deadletter`, `rebuild`) is
plain Python driven with lists and a fake clock; `worker` wires it into faust, and the Kafka
clients live in `kafka/`."""

"""The node agent (`flare agent`): local ranks' steps and in-flight tables in, Kafka out.

`core` holds the per-node state on a clock (pure, tested without sockets), `cadence` the
heartbeat policy it shares with the simulator, `outbox` the bounded queue to the publisher,
and `server` the Unix socket server and timer that drive them.
"""

"""`flare worker`: the settings become the worker's plain config at the edge."""

from __future__ import annotations

from flare.commands.worker import worker_config
from flare.settings import Settings


def test_every_consuming_knob_comes_from_the_settings() -> None:
    settings = Settings(group_id="g-7", partitions=12, max_message_bytes=1 << 20,
                        kafka_session_timeout_s=9.0, kafka_fetch_max_wait_ms=100,
                        rebuild_messages=0)
    config = worker_config(settings)
    assert (config.group_id, config.partitions, config.max_message_bytes,
            config.session_timeout_s, config.fetch_max_wait_ms, config.rebuild_messages) == (
        "g-7", 12, 1 << 20, 9.0, 100, 0)

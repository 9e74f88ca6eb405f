"""The agent's outbox: bounded, never blocking its caller, counting what it drops."""

from __future__ import annotations

import threading

from producers.agent.outbox import Outbox
from producers.testing import MemoryPublisher


class BlockedPublisher(MemoryPublisher):
    """A publisher stuck (broker away) until released."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def publish(self, topic, key, value):
        self.release.wait(10)
        super().publish(topic, key, value)


def test_outbox_is_bounded_and_counts_what_it_drops():
    pub = BlockedPublisher()
    box = Outbox(pub, max_messages=5, flush_every_s=0.05)
    box.start()
    box.put([("t", b"k", b"%d" % i) for i in range(20)])
    pub.release.set()
    box.close(10)
    # One message may already be inside the blocked publish; the queue held at most 5 more.
    assert 5 <= len(pub.messages) <= 6
    assert box.stats.dropped == 20 - len(pub.messages)
    assert box.stats.published == len(pub.messages) and pub.flushes >= 1


class FailingPublisher(MemoryPublisher):
    def publish(self, topic, key, value):
        raise RuntimeError("broker said no")

    def flush(self, timeout_s: float = 30.0) -> None:
        raise RuntimeError("still no")


def test_publisher_errors_are_counted_not_raised():
    box = Outbox(FailingPublisher(), flush_every_s=60)
    box.start()
    box.put([("t", b"k", b"1"), ("t", b"k", b"2")])
    box.close(10)
    assert (box.stats.publish_errors, box.stats.flush_errors, box.stats.published) == (2, 1, 0)

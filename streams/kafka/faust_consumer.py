"""A faust transport whose consumer waits at most `fetch_max_wait_ms` for a fetch.

faust 0.15 builds its aiokafka consumer with `fetch_max_wait_ms=1500` hard-coded. aiokafka keeps
one fetch request in flight per broker and leaves out partitions that still have buffered
records, so while the worker digests one partition the next fetch asks only for the others
and, when those are quiet (a job's heartbeats or job events), the broker holds it for the
whole 1.5 s. Measured (BENCHMARKS.md): the worker then idles 17–58% of the time even with a
backlog, and cannot keep a 2,048-GPU job in real time; with 20 ms it can.

faust offers no setting for it, so the consumer thread sets aiokafka's attribute after
building the consumer and before `start()` hands it to the fetcher.
`tests/unit/streams/kafka/test_faust_consumer.py` fails if either library renames what this
relies on.
"""

from __future__ import annotations

from typing import Any

from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread, Consumer, Transport


def transport_with_fetch_wait(fetch_max_wait_ms: int) -> type[Transport]:
    """The aiokafka transport class of faust, with the given fetch wait for worker consumers."""
    if fetch_max_wait_ms < 0:
        raise ValueError(f"fetch_max_wait_ms must be >= 0, not {fetch_max_wait_ms}")

    class FetchWaitConsumerThread(AIOKafkaConsumerThread):
        def _create_worker_consumer(self, transport: Any) -> Any:
            consumer = super()._create_worker_consumer(transport)
            consumer._fetch_max_wait_ms = fetch_max_wait_ms
            return consumer

    class FetchWaitConsumer(Consumer):
        def _new_consumer_thread(self) -> AIOKafkaConsumerThread:
            return FetchWaitConsumerThread(self, loop=self.loop, beacon=self.beacon)

    class FetchWaitTransport(Transport):
        Consumer = FetchWaitConsumer

    return FetchWaitTransport

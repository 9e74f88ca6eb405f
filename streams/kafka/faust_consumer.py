"""faust's aiokafka transport, made to hand the worker whole fetched batches.

Two changes to the consumer faust builds, both measured (BENCHMARKS.md):

- **The fetch wait.** faust 0.15 builds its aiokafka consumer with `fetch_max_wait_ms=1500`
  hard-coded. aiokafka keeps one fetch request in flight per broker and leaves out
  partitions that still have buffered records, so while the worker digests one partition
  the next fetch asks only for the others and, when those are quiet (a job's heartbeats or
  job events), the broker holds it for the whole 1.5 s: the worker idled 17–58% of the time
  with a backlog. The consumer thread sets aiokafka's attribute after building the consumer
  and before `start()` hands it to the fetcher.
- **Batches, not events.** faust delivers each record on its own: the conductor's handler
  (flow-control and producer-buffer awaits, an `Event`, a channel queue), a stream that
  sets sensors and context variables per event, and `wait_first` (two futures) around
  every delivery. At 16,384 GPUs that was a quarter of the worker's main thread. Here the
  consumer's drain loop gives each `getmany` result to one `on_batch` coroutine instead.
  What faust's loop keeps is kept: the read offsets (a re-delivered offset is dropped),
  offset gaps registered for the commit, commits every `broker_commit_every` acks, and a
  rebalance's `suspend_flow` interrupts a batch. The callee acks each message with
  `Consumer.ack` once its rows are stored, so commits mean what they meant.

`tests/unit/streams/kafka/test_faust_consumer.py` fails if either library renames what this
relies on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

from faust.transport.drivers.aiokafka import AIOKafkaConsumerThread, Consumer, Transport

BatchHandler = Callable[[list[Any]], Awaitable[None]]


def batch_transport(fetch_max_wait_ms: int, on_batch: BatchHandler) -> type[Transport]:
    """faust's aiokafka transport class, whose consumers wait at most `fetch_max_wait_ms`
    for a fetch and hand each fetched batch of messages to `on_batch`."""
    if fetch_max_wait_ms < 0:
        raise ValueError(f"fetch_max_wait_ms must be >= 0, not {fetch_max_wait_ms}")

    class FetchWaitConsumerThread(AIOKafkaConsumerThread):
        def _create_worker_consumer(self, transport: Any) -> Any:
            consumer = super()._create_worker_consumer(transport)
            consumer._fetch_max_wait_ms = fetch_max_wait_ms
            return consumer

    class BatchConsumer(Consumer):
        def _new_consumer_thread(self) -> AIOKafkaConsumerThread:
            return FetchWaitConsumerThread(self, loop=self.loop, beacon=self.beacon)

        async def _drain_messages(self, fetcher: Any) -> None:  # pragma: no cover - faust's
            stopping = self._stopped.is_set
            fetcher_stopping = fetcher._stopped.is_set
            read_offset = self._read_offset
            acks_enabled_for = self.app.topics.acks_enabled_for
            while not (stopping() or fetcher_stopping()):
                batch: list[Any] = []
                await asyncio.sleep(0)  # getmany may return at once, again and again
                if self.should_stop:
                    break
                async for tp, message in self.getmany(timeout=1.0):
                    offset = message.offset
                    last = read_offset[tp]
                    if last is not None and offset < last:
                        continue  # read before a seek back: faust drops it too
                    if last and offset - last > 1 and acks_enabled_for(message.topic):
                        await self._add_gap(tp, last + 1, offset)
                    read_offset[tp] = offset
                    batch.append(message)
                if not batch:
                    continue
                every = self._commit_every
                if every is not None and self._n_acked >= every:
                    self._n_acked = 0
                    await self.commit()
                await self.wait_first(on_batch(batch), self.suspend_flow.wait())

    class BatchTransport(Transport):
        Consumer = BatchConsumer

    return BatchTransport

"""The key of a rank's step message when its job is split across workers (issue #17).

`flare.shardsteps.v1` carries the `flare.steps.v1` value keyed `<job>/<shard>`, where the
shard is `rank // shard_ranks`: Kafka then spreads one job's shards over partitions, so stage
1 can run on as many workers as there are partitions, while every message of one shard still
meets on one of them. Producers and stage 1 agree on `shard_ranks` (`FLARE_SHARD_RANKS`).

Producers place shard `s` of a job on partition `(h(job) + s) mod n` (`shard_partition`), not
where its key hashes: 16 keys hashed onto 8 partitions seldom land two each, and a step waits
for the stage-1 worker holding the most shards (over 200 job ids, 4 workers bounded at a
median 2.67x of one, BENCHMARKS.md). Consecutive shards on consecutive partitions hold
every partition within one shard of the others. `h` is CRC-32, the same in every producer;
`n` is the topic's partition count (`FLARE_SHARD_PARTITIONS`), which every producer must
share, as they shared the key hash.

>>> shard_key("job-7", rank=70, shard_ranks=64)
'job-7/1'
>>> [shard_partition("job-7", shard, partitions=8) for shard in range(10)]
[2, 3, 4, 5, 6, 7, 0, 1, 2, 3]
>>> shard_of_key(b"job/with/slashes/3")
('job/with/slashes', 3)
>>> shard_of_key(b"job-7")
Traceback (most recent call last):
...
schemas.errors.InvalidMessage: $key: 'job-7' is not <job>/<shard>
"""

from __future__ import annotations

import zlib

from schemas.errors import InvalidMessage


def shard_key(job: str, *, rank: int, shard_ranks: int) -> str:
    """The key of `rank`'s step messages."""
    return f"{job}/{rank // shard_ranks}"


def shard_partition(job: str, shard: int, *, partitions: int) -> int:
    """The partition of `flare.shardsteps.v1` that carries `shard` of `job`."""
    return (zlib.crc32(job.encode("utf-8")) + shard) % partitions


def shard_of_key(key: bytes | None) -> tuple[str, int]:
    """(job, shard) of a key; InvalidMessage when it is not one."""
    text = (key or b"").decode("utf-8", "replace")
    job, sep, shard = text.rpartition("/")
    if not sep or not job or not shard.isdigit():
        raise InvalidMessage("$key", f"{text!r} is not <job>/<shard>")
    return job, int(shard)

"""The key of a rank's step message when its job is split across workers (issue #17).

`flare.shardsteps.v1` carries the `flare.steps.v1` value keyed `<job>/<shard>`, where the
shard is `rank // shard_ranks`: Kafka then spreads one job's shards over partitions, so stage
1 can run on as many workers as there are partitions, while every message of one shard still
meets on one of them. Producers and stage 1 agree on `shard_ranks` (`FLARE_SHARD_RANKS`).

>>> shard_key("job-7", rank=70, shard_ranks=64)
'job-7/1'
>>> shard_of_key(b"job/with/slashes/3")
('job/with/slashes', 3)
>>> shard_of_key(b"job-7")
Traceback (most recent call last):
...
schemas.errors.InvalidMessage: $key: 'job-7' is not <job>/<shard>
"""

from __future__ import annotations

from schemas.errors import InvalidMessage


def shard_key(job: str, *, rank: int, shard_ranks: int) -> str:
    """The key of `rank`'s step messages."""
    return f"{job}/{rank // shard_ranks}"


def shard_of_key(key: bytes | None) -> tuple[str, int]:
    """(job, shard) of a key; InvalidMessage when it is not one."""
    text = (key or b"").decode("utf-8", "replace")
    job, sep, shard = text.rpartition("/")
    if not sep or not job or not shard.isdigit():
        raise InvalidMessage("$key", f"{text!r} is not <job>/<shard>")
    return job, int(shard)

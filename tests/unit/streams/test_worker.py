"""The worker's faust app: built from plain values and the one Kafka connection."""

from __future__ import annotations

import ssl
from collections.abc import Callable
from typing import Any

from faust.auth import SASLCredentials
from faust.transport.drivers.aiokafka import credentials_to_aiokafka_auth
from faust.types.auth import AuthProtocol

from schemas.kafka import KafkaConnection
from streams.kafka.follow import follower_config
from streams.kafka.history import history_config

SECRET = "s3cret-not-for-logs"


def test_a_sasl_ssl_connection_reaches_faust_and_the_confluent_clients_and_nothing_else(
        worker_app: Callable[..., Any]) -> None:
    conn = KafkaConnection(bootstrap="k1:9093,k2:9093", security_protocol="SASL_SSL",
                           sasl_mechanism="SCRAM-SHA-512", sasl_username="flare",
                           sasl_password=SECRET)
    app = worker_app(conn, group_id="g-secure")

    assert [str(u) for u in app.conf.broker] == ["kafka://k1:9093", "kafka://k2:9093"]
    creds = app.conf.broker_credentials
    assert isinstance(creds, SASLCredentials) and creds.protocol == AuthProtocol.SASL_SSL
    assert isinstance(creds.ssl_context, ssl.SSLContext)
    aiokafka = credentials_to_aiokafka_auth(creds)  # what faust's consumer and producer get
    assert (aiokafka["security_protocol"], aiokafka["sasl_mechanism"]) == ("SASL_SSL",
                                                                          "SCRAM-SHA-512")
    assert (aiokafka["sasl_plain_username"], aiokafka["sasl_plain_password"]) == ("flare",
                                                                                  SECRET)

    for config in (follower_config(conn), history_config(conn, "g-secure")):
        assert config["security.protocol"] == "SASL_SSL"
        assert config["sasl.mechanism"] == "SCRAM-SHA-512"
        assert (config["sasl.username"], config["sasl.password"]) == ("flare", SECRET)
        assert config["bootstrap.servers"] == "k1:9093,k2:9093"

    for shown in (repr(conn), str(conn), repr(creds), repr(conn.model_dump())):
        assert SECRET not in shown


def test_the_group_and_the_layout_come_from_the_worker_config(
        worker_app: Callable[..., Any]) -> None:
    app = worker_app(group_id="g-7", partitions=6, session_timeout_s=9.0)
    assert app.conf.id == "g-7" and app.conf.topic_partitions == 6
    assert app.conf.broker_session_timeout == 9.0 and app.conf.broker_heartbeat_interval == 1.5
    assert app.conf.broker_credentials is None


_REUSE = """
import resource, sys
from streams.worker import tune_malloc
tuned = tune_malloc() if sys.argv[1] == "tuned" else None
def touch():
    block = bytearray(64 << 20)  # over glibc's largest mmap threshold (32 MB)
    for i in range(0, len(block), 4096):
        block[i] = 1
touch()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
touch()  # the same size again, as a worker's next step
print(tuned, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def test_a_tuned_worker_reuses_a_freed_step_sized_block_without_new_page_faults() -> None:
    """In a child process (the setting is process-wide): untuned, glibc maps the block anew
    and every 4 KB page faults again; tuned, the freed block is reused from the heap."""
    import subprocess
    import sys

    def faults(mode: str) -> tuple[str, int]:
        out = subprocess.run([sys.executable, "-c", _REUSE, mode], capture_output=True,
                             text=True, check=True).stdout.split()
        return out[0], int(out[1])

    applied, tuned = faults("tuned")
    _, plain = faults("plain")
    assert applied == "True"
    assert plain >= 8_000  # 16,384 pages of 4 KB touched afresh
    assert tuned < plain / 20


_HELD = """
from streams.worker import memory_in_use, tune_malloc
tune_malloc()
before = memory_in_use()
block = bytearray(64 << 20)  # a step's array
held = memory_in_use()
del block
after = memory_in_use()
in_use = (round(m["heap_in_use_mb"]) for m in (before, held, after))
print(*in_use, round(after["heap_kept_free_mb"]))
"""


def test_the_memory_a_freed_step_held_shows_as_kept_not_in_use() -> None:
    """A tuned worker keeps a freed step's memory resident (`tune_malloc`), so its RSS
    cannot say whether state was freed: the heap's in-use figure can. In a child process
    (the tuning is process-wide)."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _HELD], capture_output=True, text=True,
                         check=True).stdout.split()
    before, held, after, kept = (int(v) for v in out)
    assert held - before >= 63
    assert after - before <= 1
    assert kept >= 63


_TRIMMED = """
from streams.worker import IdleTrim, memory_in_use, tune_malloc
def rss_mb():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
tune_malloc()
idle = IdleTrim()
block = bytearray(64 << 20)  # a job's step
for i in range(0, len(block), 4096):
    block[i] = 1
busy = idle.observe(1)  # a job held: its memory is kept for the next step
del block
kept, rss_kept = memory_in_use()["heap_kept_free_mb"], rss_mb()
trimmed = idle.observe(0)  # the job evicted: idle
print(busy, trimmed, round(kept), round(memory_in_use()["heap_kept_free_mb"]),
      round(rss_kept - rss_mb()))
"""


def test_a_tuned_worker_gives_its_kept_heap_back_once_it_holds_no_job() -> None:
    """The freed step stays resident while a job is held, and goes back to the kernel when
    the last job is evicted: the RSS falls by the step's size. In a child process."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _TRIMMED], capture_output=True, text=True,
                         check=True).stdout.split()
    busy, trimmed = out[0], out[1]
    kept, kept_after, rss_fell = (int(v) for v in out[2:])
    assert (busy, trimmed) == ("False", "True")
    assert kept >= 63 and kept_after <= 2
    assert rss_fell >= 60

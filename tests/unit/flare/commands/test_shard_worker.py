"""`flare shard-worker`'s liveness file: touched while its loop runs, at most once a second."""

from __future__ import annotations

from pathlib import Path

from flare.commands.shard_worker import alive_beat


def test_the_loop_touches_its_alive_file_at_most_once_a_second(tmp_path: Path) -> None:
    now = [100.0]
    alive = tmp_path / "alive"
    beat = alive_beat(str(alive), lambda: now[0])
    assert beat is not None and not alive.exists()
    beat()
    assert alive.exists()
    alive.unlink()
    now[0] += 0.5
    beat()  # within the second: no write per batch
    assert not alive.exists()
    now[0] += 0.5
    beat()
    assert alive.exists()


def test_no_path_no_beat() -> None:
    assert alive_beat("", lambda: 0.0) is None

"""Hang forensics in the rank: when the stacks are taken, and what they show."""

from __future__ import annotations

import threading
from pathlib import Path

from producers.torch_hook.hook import FlareHook, HookSettings
from producers.torch_hook.stacks import StackWatch, capture_if_due, thread_stacks
from schemas.testing import FakeClock

S = 1_000_000_000


def test_the_threshold_follows_the_ranks_own_step_time_with_a_floor():
    w = StackWatch(after_s=5.0, after_steps=1.5)
    assert w.threshold_ns() == 5 * S  # no step yet: the floor
    for d in (0.1, 0.2, 0.1):
        w.step_done(int(d * S))
    assert w.threshold_ns() == 5 * S  # short steps: the floor
    for _ in range(16):
        w.step_done(40 * S)  # 40 s steps: 60 s, and the old short steps are forgotten
    assert w.threshold_ns() == 60 * S
    # a 60 s step is normal here: nothing before 60 s, then once per doubling
    assert [w.due(0, t * S) for t in (30, 59, 60, 61, 119, 120, 240)] == [
        False, False, True, False, False, True, True]
    assert not w.due(500 * S, 501 * S)  # a new step starts over


def _stuck_here(started: threading.Event, release: threading.Event) -> None:
    started.set()
    release.wait(30)


def test_the_stack_of_a_thread_stuck_in_a_function_names_that_function():
    started, release = threading.Event(), threading.Event()
    t = threading.Thread(target=_stuck_here, args=(started, release), name="trainer")
    t.start()
    started.wait(5)
    try:
        stacks = thread_stacks(t.ident, skip=frozenset({threading.get_ident()}))
    finally:
        release.set()
        t.join()
    lead = stacks[0]
    assert (lead["thread"], lead["training"]) == ("trainer", True)
    assert any(f.startswith("test_stacks.py:") and f.endswith(" in _stuck_here")
               for f in lead["frames"])
    assert all(s["thread"] != threading.current_thread().name for s in stacks)  # skipped


def test_the_hooks_table_carries_the_stacks_once_the_step_lasts_too_long(tmp_path: Path):
    clock = FakeClock()
    hook = FlareHook(job="j", node="n", socket_path=tmp_path / "none.sock", clock=clock,
                     stacks_after_s=5.0, dist=_NoDist())
    assert "stacks" not in hook._table()
    clock.advance(4.0)
    assert "stacks" not in hook._table()
    clock.advance(1.5)
    table = _on_sender_thread(hook._table)  # where the client calls it
    assert table["stacks_ts_ns"] == clock()
    lead = table["stacks"][0]  # this thread stands for the training thread (the main one)
    assert lead["training"] and any(
        f.endswith(" in test_the_hooks_table_carries_the_stacks_once_the_step_lasts_too_long")
        for f in lead["frames"])
    assert "stacks" not in hook._table()  # once, until the step's age doubles
    hook._cut()  # the step ends: the watch starts over for the next one
    clock.advance(1.0)
    assert "stacks" not in hook._table()


def test_the_floor_is_a_setting():
    assert HookSettings.from_env({"FLARE_STACKS_AFTER_S": "2.5"}).stacks_after_s == 2.5
    assert capture_if_due(StackWatch(after_s=1.0), 0, S // 2, lambda: None) is None


def _on_sender_thread(fn):  # type: ignore[no-untyped-def]
    out = []
    t = threading.Thread(target=lambda: out.append(fn()), name="flare-agent-client")
    t.start()
    t.join(10)
    return out[0]


class _NoDist:
    """torch.distributed before init: the hook is built but knows no rank yet."""

    distributed_c10d = None

    @staticmethod
    def is_available() -> bool:
        return False

    @staticmethod
    def is_initialized() -> bool:
        return False


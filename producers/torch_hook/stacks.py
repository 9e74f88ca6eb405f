"""Hang forensics inside the rank: every thread's Python stack, once the rank stops progressing.

A hang incident says who is stuck; whoever owns the training script next asks *where in the
code*. The hook's sender thread already wakes about every second; when the rank's current
step has lasted well past its own usual step time, it reads every thread's frames
(`sys._current_frames`, the interpreter's own table: no signal, no pause of training beyond
the GIL it takes to copy them) and sends them with the next in-flight table. The peers of a
stuck rank wait in a collective and take theirs too, so the worker can merge the job's stacks
and show the odd one out (`detectors.stacks`).

When: the step has lasted `after_steps` usual steps (median of the last few) and at least
`after_s`, then again each time that doubles. The threshold is about half the detector's hang
timeout (3 steps, 10 s floor), so the stacks are there when the hang opens; a long
checkpoint step sends one set and costs nothing more.
"""

from __future__ import annotations

import sys
import threading
import traceback
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

MAX_THREADS = 16
MAX_FRAMES = 40  # innermost frames per thread
_OWN = str(Path(__file__).resolve().parent)  # the hook's own frames say nothing of training


def frame_text(fs: traceback.FrameSummary) -> str:
    """`file:line in function`, the form exit reports use: the file's name only, so the
    same code on ranks with different install paths gives the same frame."""
    return f"{Path(fs.filename).name}:{fs.lineno} in {fs.name}"[:300]


def thread_stacks(training: int | None, skip: frozenset[int] = frozenset(),
                  max_threads: int = MAX_THREADS, max_frames: int = MAX_FRAMES
                  ) -> list[dict[str, Any]]:
    """Every thread's stack, outermost frame first; the training thread (`training`, else
    the main thread) first and marked, then the others by name; the hook's own frames and
    the threads in `skip` are left out.

    >>> here = thread_stacks(threading.get_ident())
    >>> here[0]["training"], any("stacks.py" in f for f in here[0]["frames"])
    (True, False)
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    lead = training if training is not None else threading.main_thread().ident
    out: list[dict[str, Any]] = []
    for ident, frame in sys._current_frames().items():
        if ident in skip:
            continue
        frames = [frame_text(fs) for fs in traceback.extract_stack(frame, limit=max_frames)
                  if not fs.filename.startswith(_OWN)]
        out.append({"thread": names.get(ident, f"thread-{ident}"), "frames": frames,
                    "training": ident == lead})
    out.sort(key=lambda t: (not t["training"], t["thread"]))
    return out[:max_threads]


class StackWatch:
    """Says when the rank's current step has lasted long enough to take its stacks.

    Fed from the sender thread: `step_done` with each finished step's duration, `due` with
    the start of the current step (the op log's `step_t0`) and now. Holds no reference to
    training state, so it is tested with plain numbers.

    >>> w = StackWatch(after_s=5.0, after_steps=1.5)
    >>> for _ in range(4):
    ...     w.step_done(4_000_000_000)          # 4 s steps: threshold 6 s
    >>> [w.due(0, t * 1_000_000_000) for t in (5, 6, 7, 11, 12, 24)]
    [False, True, False, False, True, True]
    """

    def __init__(self, after_s: float = 5.0, after_steps: float = 1.5, history: int = 16
                 ) -> None:
        self.after_ns = int(after_s * 1e9)
        self.after_steps = after_steps
        self.durations: deque[int] = deque(maxlen=history)
        self._step_t0 = -1
        self._next_ns = 0  # how long the current step must last for the next capture

    def step_done(self, duration_ns: int) -> None:
        if duration_ns > 0:
            self.durations.append(duration_ns)

    def threshold_ns(self) -> int:
        if not self.durations:
            return self.after_ns
        usual = sorted(self.durations)[len(self.durations) // 2]
        return max(self.after_ns, int(self.after_steps * usual))

    def due(self, step_t0_ns: int, now_ns: int) -> bool:
        """True once per doubling of the current step's age past the threshold."""
        if step_t0_ns != self._step_t0:
            self._step_t0 = step_t0_ns
            self._next_ns = self.threshold_ns()
        if now_ns - step_t0_ns < self._next_ns:
            return False
        self._next_ns *= 2
        return True


def capture_if_due(watch: StackWatch, step_t0_ns: int, now_ns: int,
                   training: Callable[[], int | None]) -> dict[str, Any] | None:
    """The stacks to send with the in-flight table now, or None: what the sender calls."""
    if not watch.due(step_t0_ns, now_ns):
        return None
    return {"stacks": thread_stacks(training(), frozenset({threading.get_ident()})),
            "stacks_ts_ns": now_ns}

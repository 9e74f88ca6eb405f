"""JobDiagnoser: the whole detection pipeline of one job, fed messages in arrival order.

The stream worker owns one per job (on the job's partition) and `flare diagnose` one per job
of a recording; both call exactly these methods, so offline and online answers are the same.
Time is an input: the diagnoser's clock is the stream time of the messages (and `tick` for
when messages stop), never the wall clock.
"""

from __future__ import annotations

from flare.detectors.frame import StepFrame
from flare.detectors.report import DiagnoserOutput
from flare.schemas.rankstep import RankStep
from flare.schemas.wire import HeartbeatV1, JobV1
from flare.settings import DetectorSettings


class JobDiagnoser:
    """All detector state of one job; bounded in size whatever the length of the job."""

    def __init__(self, job: str, settings: DetectorSettings | None = None) -> None:
        self.job = job
        self.settings = settings or DetectorSettings()

    def on_steps(self, msg: RankStep) -> DiagnoserOutput:
        """One rank-step message; returns the reports of any steps it completed."""
        raise NotImplementedError

    def on_heartbeat(self, hb: HeartbeatV1) -> DiagnoserOutput:
        """One heartbeat; advances stream time, so it may complete steps or open a hang."""
        raise NotImplementedError

    def on_job(self, ev: JobV1) -> DiagnoserOutput:
        """A job start (layout, topology) or end (flushes pending steps)."""
        raise NotImplementedError

    def on_frame(self, frame: StepFrame) -> DiagnoserOutput:
        """An already assembled step (the simulator's fast path)."""
        raise NotImplementedError

    def tick(self, now_ns: int) -> DiagnoserOutput:
        """Advance stream time with no message (grace periods, hang timeouts)."""
        raise NotImplementedError

    def flush(self) -> DiagnoserOutput:
        """End of input: assemble what is pending."""
        raise NotImplementedError

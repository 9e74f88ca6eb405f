"""The Prometheus text format (0.0.4), as every Flare process that serves `/metrics` writes it.

A scrape crosses a process boundary like a Kafka message does, so its format has one home:
the node agent, the stream worker and the API all build their pages with `Exposition`.
Families are written once (HELP, TYPE), samples after them; label values are escaped as the
format asks; histograms get their cumulative `_bucket{le=…}`, `_sum` and `_count`.

>>> page = Exposition()
>>> page.family("flare_demo_total", "counter", "Things done, by kind.")
>>> page.sample("flare_demo_total", {"kind": 'say "hi"'}, 3)
>>> page.histogram("flare_demo_seconds", "How long a thing took.", {}, (0.1, 1.0), [0.05, 0.5, 2.0])
>>> print(page.text(), end="")
# HELP flare_demo_total Things done, by kind.
# TYPE flare_demo_total counter
flare_demo_total{kind="say \\"hi\\""} 3
# HELP flare_demo_seconds How long a thing took.
# TYPE flare_demo_seconds histogram
flare_demo_seconds_bucket{le="0.1"} 1
flare_demo_seconds_bucket{le="1"} 2
flare_demo_seconds_bucket{le="+Inf"} 3
flare_demo_seconds_sum 2.55
flare_demo_seconds_count 3
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Exposition:
    """One page of metrics in Prometheus text format 0.0.4."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def family(self, name: str, kind: str, help_text: str) -> None:
        self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]

    def sample(self, name: str, labels: dict[str, str], value: float) -> None:
        self.lines.append(f"{name}{_labels(labels)} {_number(value)}")

    def histogram(self, name: str, help_text: str, labels: dict[str, str],
                  bounds: Sequence[float], values: Iterable[float]) -> None:
        """A histogram family of `values` over the upper `bounds` (an +Inf bucket added)."""
        v = np.fromiter(values, dtype=float)
        self.family(name, "histogram", help_text)
        self.histogram_samples(name, labels, bounds,
                               np.searchsorted(np.sort(v), bounds, side="right").tolist(),
                               float(v.sum()), int(v.size))

    def histogram_samples(self, name: str, labels: dict[str, str], bounds: Sequence[float],
                          cumulative: Sequence[int], total: float, count: int) -> None:
        """The samples of one histogram series from cumulative counts per bound."""
        for le, c in zip(bounds, cumulative, strict=True):
            self.sample(f"{name}_bucket", {**labels, "le": _number(le)}, c)
        self.sample(f"{name}_bucket", {**labels, "le": "+Inf"}, count)
        self.sample(f"{name}_sum", labels, total)
        self.sample(f"{name}_count", labels, count)

    def text(self) -> str:
        return "\n".join(self.lines) + "\n"


def _number(value: float | str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int):
        return str(value)
    return f"{value:.10g}"


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    return "{" + ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(labels.items())) + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')

"""A minimal Prometheus text-exposition writer: counters, gauges, histograms with labels.

Single-threaded use (the event loop); no dependency on prometheus_client.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

Labels = tuple[str, ...]

__all__ = ["Counter", "Gauge", "Histogram", "Metric"]


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    parts = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        parts.append(extra)
    return "{" + ",".join(parts) + "}" if parts else ""


def _num(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Metric:
    kind = "untyped"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        self.name = name
        self.help = help_text
        self.labelnames = tuple(labelnames)

    def header(self) -> list[str]:
        return [f"# HELP {self.name} {self.help}", f"# TYPE {self.name} {self.kind}"]

    def render(self) -> list[str]:
        raise NotImplementedError


class Counter(Metric):
    kind = "counter"

    def __init__(self, name: str, help_text: str, labelnames: Sequence[str] = ()) -> None:
        super().__init__(name, help_text, labelnames)
        self._values: dict[Labels, float] = {}

    def inc(self, *labels: str, amount: float = 1.0) -> None:
        self._values[labels] = self._values.get(labels, 0.0) + amount

    def value(self, *labels: str) -> float:
        return self._values.get(labels, 0.0)

    def render(self) -> list[str]:
        lines = self.header()
        for labels, value in sorted(self._values.items()):
            lines.append(f"{self.name}{_label_text(self.labelnames, labels)} {_num(value)}")
        return lines


class Gauge(Counter):
    kind = "gauge"

    def set(self, *labels: str, value: float) -> None:
        self._values[labels] = value

    def dec(self, *labels: str, amount: float = 1.0) -> None:
        self.inc(*labels, amount=-amount)


class Histogram(Metric):
    kind = "histogram"

    def __init__(
        self, name: str, help_text: str, buckets: Sequence[float], labelnames: Sequence[str] = ()
    ) -> None:
        super().__init__(name, help_text, labelnames)
        self.buckets = tuple(sorted(buckets))
        self._counts: dict[Labels, list[int]] = {}
        self._sums: dict[Labels, float] = {}

    def observe(self, *labels: str, value: float) -> None:
        counts = self._counts.setdefault(labels, [0] * (len(self.buckets) + 1))
        counts[bisect.bisect_left(self.buckets, value)] += 1
        self._sums[labels] = self._sums.get(labels, 0.0) + value

    def count(self, *labels: str) -> int:
        return sum(self._counts.get(labels, ()))

    def render(self) -> list[str]:
        lines = self.header()
        for labels, counts in sorted(self._counts.items()):
            cumulative = 0
            for bound, n in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += n
                le = f'le="{_num(bound)}"'
                lines.append(
                    f"{self.name}_bucket{_label_text(self.labelnames, labels, le)} {cumulative}"
                )
            text = _label_text(self.labelnames, labels)
            lines.append(f"{self.name}_sum{text} {_num(self._sums[labels])}")
            lines.append(f"{self.name}_count{text} {cumulative}")
        return lines

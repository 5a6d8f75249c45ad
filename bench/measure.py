"""One load run with the CPU of the processes under test and of the whole machine read around it."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench import load
from bench.procs import busy_cores, loadavg, machine_ticks


@dataclass
class Measured:
    """A load result plus what the processes and the machine spent during its measured phase."""

    load: load.LoadResult
    cpu_s: dict[str, float]
    """CPU seconds per named process (edge, node, nats, upstream, client) during the measured phase."""
    busy_cores: float
    """Cores busy on average, whole machine (2.0 = both cores here)."""
    other_cores: float
    """Busy cores not spent by our processes: colleagues' work on the same machine during the run."""
    loadavg: list[float]

    def per_1k(self, name: str) -> float | None:
        n = self.load.count
        return round(1000.0 * self.cpu_s.get(name, 0.0) / n, 3) if n else None

    def brief(self) -> dict[str, Any]:
        return {
            **self.load.brief(),
            "cpu_s": {k: round(v, 3) for k, v in self.cpu_s.items()},
            "busy_cores": self.busy_cores,
            "other_cores": self.other_cores,
            "loadavg": self.loadavg,
        }


def run_measured(spec: load.LoadSpec, counters: dict[str, Callable[[], float]], procs: int = 1) -> Measured:
    """Run `spec`; `counters` read each process's CPU seconds so far (read just before and after)."""
    before: dict[str, float] = {}
    marks: dict[str, Any] = {}

    def on_start() -> None:
        marks["ticks"] = machine_ticks()
        marks["t"] = time.monotonic()
        for name, read in counters.items():
            before[name] = read()

    result = load.run(spec, procs, on_start)
    after = {name: read() for name, read in counters.items()}
    ticks = machine_ticks()
    wall = max(1e-9, time.monotonic() - marks["t"])
    cpu = {name: max(0.0, after[name] - before[name]) for name in counters}
    cpu["client"] = result.client_cpu_s
    busy = busy_cores(marks["ticks"], ticks)
    other = max(0.0, busy - sum(cpu.values()) / wall)
    return Measured(result, cpu, busy, round(other, 3), loadavg())


def spread(values: list[float | None], digits: int = 3) -> dict[str, float] | None:
    """Median and range over rounds."""
    v = [x for x in values if x is not None]
    if not v:
        return None
    return {
        "median": round(statistics.median(v), digits),
        "min": round(min(v), digits),
        "max": round(max(v), digits),
        "n": len(v),
    }

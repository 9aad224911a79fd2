"""CPU time of the benchmark's processes, from their own kernel counters (psutil), per window.

Tells whether the gateway, the synthetic engine or the load generator ran out of CPU, and what
the gateway spends per relayed chunk. Reads counters only; starts and stops nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import psutil


def cpu_seconds(processes: Sequence[psutil.Process]) -> float:
    """User + system CPU seconds of ``processes``; one that has exited counts as nothing."""
    total = 0.0
    for process in processes:
        try:
            times = process.cpu_times()
        except psutil.NoSuchProcess:
            continue
        total += times.user + times.system
    return total


def with_descendants(process: psutil.Process) -> list[psutil.Process]:
    """``process`` and every process under it now (a gateway and its workers)."""
    return [process, *process.children(recursive=True)]


class CpuMeter:
    """Reads the CPU counters of named groups of processes, each group listed in full: a process's
    children count only where listed (``with_descendants``). The load generator's own process is
    the parent of the services it measures, so its group is itself and its load processes.
    """

    def __init__(self, groups: Mapping[str, Sequence[psutil.Process]]) -> None:
        self._groups = {name: list(processes) for name, processes in groups.items()}

    def read(self) -> dict[str, tuple[float, ...]]:
        """CPU seconds so far of each process, by group name."""
        return {name: tuple(cpu_seconds([process]) for process in processes) for name, processes in self._groups.items()}


@dataclass(frozen=True, slots=True)
class CpuUse:
    """The CPU one group of processes used during one window of wall time."""

    seconds: float  # all its processes together
    window_s: float
    busiest_cores: float = 0.0  # the share of a core its busiest process kept busy (1.0: all the time)

    @property
    def cores(self) -> float:
        """Average cores busy: 1.0 = one core all the time."""
        return self.seconds / self.window_s if self.window_s > 0 else 0.0


def cpu_use(
    before: Mapping[str, Sequence[float]], after: Mapping[str, Sequence[float]], *, window_s: float
) -> dict[str, CpuUse]:
    """Each group's CPU between two ``CpuMeter.read()``s ``window_s`` apart. Pure."""
    uses = {}
    for name in before:
        used_s = [end_s - start_s for start_s, end_s in zip(before[name], after[name], strict=True)]
        uses[name] = CpuUse(seconds=sum(used_s), window_s=window_s,
                            busiest_cores=max(used_s, default=0.0) / window_s if window_s > 0 else 0.0)
    return uses


def summed(uses: list[CpuUse]) -> CpuUse:
    """Several windows of one group as one; its busiest process is the busiest window's."""
    return CpuUse(seconds=sum(use.seconds for use in uses), window_s=sum(use.window_s for use in uses),
                  busiest_cores=max((use.busiest_cores for use in uses), default=0.0))


def per_item_us(cpu_s: float, items: int) -> float | None:
    """Microseconds of CPU per item (chunk, request); None when nothing was counted. Pure."""
    return cpu_s / items * 1e6 if items > 0 else None

"""CPU time of the benchmark's processes, from their own kernel counters (psutil), per window.

Tells whether the gateway, the synthetic engine or the load generator ran out of CPU, and what
the gateway spends per relayed chunk. Reads counters only; starts and stops nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

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


def thread_seconds(process: psutil.Process, name: str | None) -> float:
    """User + system CPU seconds of ``process``'s threads called ``name`` (Linux: /proc/PID/task/TID/comm);
    nothing when ``name`` is None or the process has exited."""
    if name is None:
        return 0.0
    total = 0.0
    try:
        threads = process.threads()
    except psutil.NoSuchProcess:
        return 0.0
    for thread in threads:
        try:
            is_named = Path(f"/proc/{process.pid}/task/{thread.id}/comm").read_text().strip() == name
        except OSError:  # the thread ended since
            continue
        if is_named:
            total += thread.user_time + thread.system_time
    return total


def with_descendants(process: psutil.Process) -> list[psutil.Process]:
    """``process`` and every process under it now (a gateway and its workers)."""
    return [process, *process.children(recursive=True)]


class CpuMeter:
    """Reads the CPU counters of named groups of processes, each group listed in full: a process's
    children count only where listed (``with_descendants``). The load generator's own process is
    the parent of the services it measures, so its group is itself and its load processes.
    """

    def __init__(self, groups: Mapping[str, Sequence[psutil.Process]], *,
                 named_threads: Mapping[str, tuple[str, str | None]] | None = None) -> None:
        """``named_threads``: more groups, each the threads of one name in another group's processes,
        as ``{group: (of_group, thread_name)}`` (the gateway's relay threads: part of its CPU, told apart)."""
        self._groups = {name: list(processes) for name, processes in groups.items()}
        self._named_threads = dict(named_threads or {})

    def read(self) -> dict[str, tuple[float, ...]]:
        """CPU seconds so far of each process (or of its named threads), by group name."""
        readings = {name: tuple(cpu_seconds([process]) for process in processes)
                    for name, processes in self._groups.items()}
        for name, (of_group, thread_name) in self._named_threads.items():
            readings[name] = tuple(thread_seconds(process, thread_name) for process in self._groups[of_group])
        return readings


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

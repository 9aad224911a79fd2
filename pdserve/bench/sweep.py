"""Run one workload against several targets at several load levels, interleaved: for each level,
every target in turn, so drift and noise spread over all of them. Returns one Point per pair.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import aiohttp

from pdserve.bench import runner
from pdserve.bench.points import Point
from pdserve.bench.records import RequestRecord
from pdserve.bench.stats import Slo, summarize, whole_run
from pdserve.bench.workload import BenchRequest, poisson_arrivals

# A progress display: given a label and the number of requests (None if open-ended), a context
# whose value is called once per finished request.
ProgressBar = Callable[[str, int | None], AbstractContextManager[runner.OnDone]]
# (count, salt) -> requests: the same lengths for every salt, different prompt text.
Workload = Callable[[int, int], list[BenchRequest]]


class Load(Protocol):
    """How requests are offered: ``level`` is what the report plots on its x axis."""

    @property
    def level(self) -> float: ...

    @property
    def request_count(self) -> int: ...  # distinct requests to build

    @property
    def planned_requests(self) -> int | None: ...  # how many will be sent, if known up front

    async def drive(
        self, session: aiohttp.ClientSession, target: runner.Target, requests: Sequence[BenchRequest], *,
        timeout_s: float, on_done: runner.OnDone,
    ) -> list[RequestRecord]: ...


@dataclass(frozen=True, slots=True)
class PoissonLoad:
    """Open loop: Poisson arrivals at ``rate`` requests/s for about ``duration_s``.

    A trace's own timestamps, when every request has one, replace the Poisson arrivals.
    """

    rate: float
    duration_s: float
    seed: int = 0

    @property
    def level(self) -> float:
        return self.rate

    @property
    def request_count(self) -> int:
        return max(1, round(self.rate * self.duration_s))

    @property
    def planned_requests(self) -> int | None:
        return self.request_count

    async def drive(
        self, session: aiohttp.ClientSession, target: runner.Target, requests: Sequence[BenchRequest], *,
        timeout_s: float, on_done: runner.OnDone,
    ) -> list[RequestRecord]:
        traced = [request.at_s for request in requests if request.at_s is not None]
        arrivals_s = traced if len(traced) == len(requests) else poisson_arrivals(
            len(requests), rate=self.rate, seed=self.seed)
        return await runner.run_open_loop(session, target, requests, arrivals_s, timeout_s=timeout_s, on_done=on_done)


@dataclass(frozen=True, slots=True)
class StreamsLoad:
    """Closed loop: ``streams`` requests always in flight for ``duration_s`` (requests reused in turn)."""

    streams: int
    duration_s: float

    @property
    def level(self) -> float:
        return self.streams

    @property
    def request_count(self) -> int:
        return self.streams * 4

    @property
    def planned_requests(self) -> int | None:
        return None

    async def drive(
        self, session: aiohttp.ClientSession, target: runner.Target, requests: Sequence[BenchRequest], *,
        timeout_s: float, on_done: runner.OnDone,
    ) -> list[RequestRecord]:
        return await runner.run_closed_loop(
            session, target, itertools.cycle(requests), streams=self.streams, duration_s=self.duration_s,
            stagger_s=0.0, timeout_s=timeout_s, on_done=on_done,
        )


async def sweep(
    targets: Sequence[runner.Target], loads: Sequence[Load], *, workload: Workload, slo: Slo, timeout_s: float,
    progress: ProgressBar,
) -> list[Point]:
    """Every target at every load level; at a level, each target gets requests of the same lengths
    at the same moments, with text of its own (a salt per target and level).
    """
    points = []
    async with runner.new_session() as session:
        for level_index, load in enumerate(loads):
            for target_index, target in enumerate(targets):
                requests = workload(load.request_count, level_index * len(targets) + target_index)
                with progress(f"{target.name} @ {load.level:g}", load.planned_requests) as on_done:
                    records = await load.drive(session, target, requests, timeout_s=timeout_s, on_done=on_done)
                summary = summarize(records, slo=slo, windows=[whole_run(records)])
                points.append(Point(target=target.name, load=load.level, summary=summary))
    return points

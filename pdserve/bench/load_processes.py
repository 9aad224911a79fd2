"""``bench overhead``'s load generator as several processes: each runs its share of a window's
closed-loop streams on its own event loop (bench/streams.py) and sends back what it recorded,
so the load generator gets as many cores as it is given and is not what runs out first.

The processes are started once for a sweep and take one window at a time over a pipe. Their
timestamps and the parent's windows share one clock: time.perf_counter() is CLOCK_MONOTONIC,
system-wide, on Linux.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import multiprocessing
import signal
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from types import TracebackType
from typing import Self

import psutil
import uvloop

from pdserve.bench.records import RequestRecord
from pdserve.bench.runner import Target
from pdserve.bench.streams import run_streams
from pdserve.bench.workload import BenchRequest
from pdserve.errors import BenchFailed

STREAMS_PER_PROCESS = 256  # what one process offers at 100 tokens/s with most of a core to spare
_STOP_TIMEOUT_S = 10.0


@dataclass(frozen=True, slots=True)
class Share:
    """One process's part of a window."""

    target: Target
    streams: int
    first_start_s: float  # time.perf_counter() when this process's first stream starts
    stagger_s: float  # its stream j starts j * stagger_s / streams after its first
    stop_s: float  # time.perf_counter(): no request starts after this
    timeout_s: float  # per request


def default_load_processes(streams: int, *, cores: int) -> int:
    """One process per STREAMS_PER_PROCESS streams, on at most half the cores (the gateway and the
    synthetic engine need the rest), and at least one. Pure."""
    return max(1, min(cores // 2, math.ceil(streams / STREAMS_PER_PROCESS)))


def deal(
    target: Target, *, streams: int, processes: int, start_s: float, ramp_s: float, stop_s: float, timeout_s: float,
) -> list[Share]:
    """``streams`` dealt round-robin over ``processes``: stream i (of all) starts at
    ``start_s + i * ramp_s / streams``, as one process would start them. Pure."""
    shares = []
    for index in range(min(processes, streams)):
        count = len(range(index, streams, processes))
        shares.append(Share(target, streams=count, first_start_s=start_s + index * ramp_s / streams,
                            stagger_s=count * processes * ramp_s / streams, stop_s=stop_s, timeout_s=timeout_s))
    return shares


class LoadProcesses:
    """``count`` load processes: ``async with`` returns once every one is ready to run a share,
    and stops them all at the end of the block."""

    def __init__(self, count: int, requests: Sequence[BenchRequest]) -> None:
        self._count, self._requests = count, list(requests)
        self._processes: list[BaseProcess] = []
        self._pipes: list[Connection] = []

    async def __aenter__(self) -> Self:
        context = multiprocessing.get_context("spawn")
        for index in range(self._count):
            parent_end, child_end = context.Pipe()
            process = context.Process(target=_serve, args=(child_end, self._requests), daemon=True,
                                      name=f"pdserve-load-{index}")
            process.start()
            child_end.close()
            self._processes.append(process)
            self._pipes.append(parent_end)
        try:
            await asyncio.gather(*(asyncio.to_thread(_receive, pipe) for pipe in self._pipes))  # each says it is ready
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        for pipe in self._pipes:
            pipe.close()  # the process sees EOF and exits
        await asyncio.to_thread(_stop, self._processes)

    @property
    def processes(self) -> list[psutil.Process]:
        """The running load processes, for their CPU counters."""
        return [psutil.Process(process.pid) for process in self._processes if process.pid is not None]

    async def run(
        self, target: Target, *, streams: int, start_s: float, ramp_s: float, stop_s: float, timeout_s: float,
    ) -> list[RequestRecord]:
        """Every process's share of ``streams`` (see ``deal``), merged; raises BenchFailed when a process dies."""
        shares = deal(target, streams=streams, processes=self._count, start_s=start_s, ramp_s=ramp_s,
                      stop_s=stop_s, timeout_s=timeout_s)
        pipes = self._pipes[:len(shares)]
        for pipe, share in zip(pipes, shares, strict=True):
            pipe.send(share)
        replies = await asyncio.gather(*(asyncio.to_thread(_receive, pipe) for pipe in pipes))
        return [record for reply in replies for record in reply]


def _stop(processes: Sequence[BaseProcess]) -> None:
    for process in processes:
        process.join(_STOP_TIMEOUT_S)
        if process.is_alive():
            process.kill()
            process.join()


def _receive(pipe: Connection) -> list[RequestRecord]:
    try:
        records: list[RequestRecord] = pipe.recv()
    except EOFError as exc:
        raise BenchFailed("a load process exited during a window (its traceback is above)") from exc
    return records


def _serve(pipe: Connection, requests: list[BenchRequest]) -> None:
    """One load process: run each share it is sent and answer with its records, until the parent
    closes the pipe. An error ends the process with its traceback on stderr."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops us
    load = itertools.cycle(requests)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        pipe.send([])  # ready: imports done, loop made
        while True:
            try:
                share: Share = pipe.recv()
            except EOFError:
                return
            pipe.send(runner.run(_run_share(share, load)))


async def _run_share(share: Share, load: Iterator[BenchRequest]) -> list[RequestRecord]:
    await asyncio.sleep(max(0.0, share.first_start_s - time.perf_counter()))
    return await run_streams(share.target, load, streams=share.streams, stagger_s=share.stagger_s,
                             stop_s=share.stop_s, timeout_s=share.timeout_s)

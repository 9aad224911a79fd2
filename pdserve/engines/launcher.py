"""Start one engine subprocess, wait until it answers ``/health``, stop it with its children.

Each engine runs in its own process group and is told to die with us (PR_SET_PDEATHSIG), so
Ctrl-C, SIGTERM or even a SIGKILL of pdserve leaves no engine behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import functools
import os
import signal
import socket
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import IO

import aiohttp

from pdserve.engine_config import EngineSpec
from pdserve.engines.command import (
    COMPILE_CACHE_ENV,
    CPU_BIND_ENV,
    DEFAULT_COMPILE_CACHE,
    EngineCommand,
    engine_environ,
)
from pdserve.engines.cpu_affinity import confine_engine, parse_cpu_list
from pdserve.engines.kv_path import NOTE_PREFIX
from pdserve.engines.start_failure import describe_failure
from pdserve.engines.start_phase import COMPILING, PhaseChange, StartPhaseLog
from pdserve.errors import EngineStartFailed

_PR_SET_PDEATHSIG = 1
PROGRESS_EVERY_S = 10.0
START_MARKER = "\n=== pdserve: starting "  # opens each start's part of the log, which restarts append to
# How much of a log's end is searched for the root cause: a failed GPU start's tracebacks (the engine core's
# twice, then the API server's) and what vLLM logs while it shuts down fit many times over.
CAUSE_SEARCH_BYTES = 1 << 20


def _prepare_child(cores: set[int]) -> None:
    """Runs in the child before exec: the kernel SIGTERMs it when pdserve exits, and a CPU engine
    runs on its own ``cores``, with every process and thread it starts."""
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if cores:
        os.sched_setaffinity(0, cores)


class EngineProcess:
    """One vLLM server process and its log file."""

    def __init__(self, spec: EngineSpec, command: EngineCommand, *, log_path: Path) -> None:
        self.spec, self.command, self.log_path = spec, command, log_path
        self._process: asyncio.subprocess.Process | None = None
        self._log_file: IO[bytes] | None = None

    def renew(self, spec: EngineSpec, command: EngineCommand) -> None:
        """Start next as ``spec`` with ``command`` (a restart under a new NIXL engine id)."""
        assert not self.is_running, "renewed while it runs"
        self.spec, self.command = spec, command

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    @property
    def cores(self) -> set[int]:
        """The cores a CPU engine runs on (VLLM_CPU_OMP_THREADS_BIND); empty for a GPU engine."""
        return parse_cpu_list(self.command.env.get(CPU_BIND_ENV, ""))

    @property
    def is_running(self) -> bool:
        return self._process is not None and self._process.returncode is None

    async def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log_file = self.log_path.open("ab")
        self._log_file.write(f"{START_MARKER}{self.spec.name}: {' '.join(self.command.argv)}\n".encode())
        self._log_file.write("".join(f"{NOTE_PREFIX}{note}\n" for note in self.command.notes).encode())
        self._log_file.flush()
        self._process = await asyncio.create_subprocess_exec(
            *self.command.argv,
            env=engine_environ(os.environ, self.command),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=self._log_file,
            stderr=asyncio.subprocess.STDOUT,
            start_new_session=True,
            preexec_fn=functools.partial(_prepare_child, self.cores),
        )

    async def wait_exit(self) -> int:
        assert self._process is not None, "engine not started"
        return await self._process.wait()

    async def wait_ready(
        self, session: aiohttp.ClientSession, *, timeout_s: float, progress: Callable[[str], None]
    ) -> float:
        """Poll ``/health`` until 200; returns seconds waited. Prints progress every 10 s: the phase of
        the start (loading weights, compiling, capturing CUDA graphs) and how long it has lasted.

        Raises EngineStartFailed when the process exits or ``timeout_s`` passes, quoting the
        end of its log so the cause is on screen.
        """
        started_s = last_report_s = time.monotonic()
        phases = StartPhaseLog(self.log_path, now_s=started_s)
        url = f"{self.spec.base_url}/health"
        while True:
            if not self.is_running:
                raise EngineStartFailed(self.failure("exited during start-up"))
            waited_s = time.monotonic() - started_s
            if waited_s > timeout_s:
                raise EngineStartFailed(self.failure(f"not ready after {timeout_s:.0f} s"))
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(url, timeout=aiohttp.ClientTimeout(total=2.0)) as reply:
                    if reply.status == 200:
                        return waited_s
            now_s = time.monotonic()
            phase = phases.read(now_s=now_s)
            if now_s - last_report_s >= PROGRESS_EVERY_S:
                last_report_s = now_s
                progress(f"  {self.spec.name:<10} loading  {waited_s:5.0f}s  | {self._describe(phase, now_s=now_s)}")
            await asyncio.sleep(0.5)

    def _describe(self, phase: PhaseChange, *, now_s: float) -> str:
        """The phase and its length; while compiling, where the cache goes that spares the next start."""
        described = f"{phase.phase}, {now_s - phase.at_s:.0f}s so far"
        if phase.phase == COMPILING:
            described += f" (cached in {self.command.env.get(COMPILE_CACHE_ENV, DEFAULT_COMPILE_CACHE)} for the next start)"
        return described

    async def stop(self, *, grace_s: float = 20.0) -> None:
        """SIGTERM the engine's process group, SIGKILL it after ``grace_s``; closes the log."""
        process = self._process
        if process is not None and process.returncode is None:
            _signal_group(process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(process.wait(), timeout=grace_s)
            except TimeoutError:
                _signal_group(process.pid, signal.SIGKILL)
                await process.wait()
        if process is not None:
            _signal_group(process.pid, signal.SIGKILL)  # stragglers such as vLLM's EngineCore
        if self._log_file is not None:
            self._log_file.close()
            self._log_file = None

    def failure(self, what: str) -> str:
        """An error message: ``what`` happened to this engine, then the root cause in its log (the exception
        vLLM's "See root cause above" points to) with pdserve's advice, then the log's path and last lines."""
        cause = describe_failure(self.log_text())
        head = f"{self.spec.name} {what}" + (f": {cause}" if cause else "")
        return f"{head}\n  log {self.log_path}, its last lines:\n{self.log_tail()}"

    def log_text(self) -> str:
        """The end of the log written since this engine last started (at most CAUSE_SEARCH_BYTES)."""
        try:
            with self.log_path.open("rb") as log:
                log.seek(max(0, log.seek(0, os.SEEK_END) - CAUSE_SEARCH_BYTES))
                text = log.read().decode(errors="replace")
        except OSError:
            return ""
        return text.rsplit(START_MARKER, 1)[-1]

    def log_tail(self, lines: int = 15) -> str:
        try:
            with self.log_path.open("rb") as log:
                tail = deque(log, maxlen=lines)
        except OSError:
            return ""
        return b"".join(tail).decode(errors="replace").rstrip()


async def bring_up(
    engine: EngineProcess, session: aiohttp.ClientSession, *, timeout_s: float, progress: Callable[[str], None]
) -> None:
    """Wait until a started engine is ready, then keep its threads on its own cores.

    Raises EngineStartFailed as ``EngineProcess.wait_ready`` does.
    """
    waited_s = await engine.wait_ready(session, timeout_s=timeout_s, progress=progress)
    progress(f"  {engine.spec.name:<10} ready    {waited_s:5.0f}s  {engine.spec.base_url}")
    if engine.pid is not None:
        moved = confine_engine(engine.pid, engine.cores)
        if moved:
            progress(f"  {engine.spec.name:<10} pinned   {len(moved)} thread(s) back onto cores "
                     f"{engine.command.env[CPU_BIND_ENV]} "
                     f"(vLLM-CPU's NIXL setup had moved them)")


def busy_ports(ports: list[int]) -> list[int]:
    """Those of ``ports`` something on this host already listens on (a stale engine, say)."""
    busy = []
    for port in ports:
        with socket.socket() as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as servers do: TIME_WAIT is fine
            try:
                probe.bind(("127.0.0.1", port))
            except OSError:
                busy.append(port)
    return busy


def _signal_group(pid: int, signum: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signum)

"""Keep the configured engines alive: start them together, restart one that dies, stop all."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import Callable
from dataclasses import replace

import aiohttp

from pdserve.config import EngineSpec, Settings
from pdserve.engines.command import build_engine_command, split_cpus
from pdserve.engines.kv_link import probe_host_link
from pdserve.engines.launcher import EngineProcess, bring_up
from pdserve.engines.model_layout import ModelLayout
from pdserve.engines.mps import MpsDaemon, plan_mps
from pdserve.engines.nixl_plugins import backend_problems
from pdserve.errors import EngineStartFailed

log = logging.getLogger(__name__)


class Supervisor:
    def __init__(
        self, settings: Settings, *, model_path: str, layout: ModelLayout, progress: Callable[[str], None]
    ) -> None:
        """Plans every engine's command, so a model the pools cannot hand off is refused (ConfigError)
        before any engine starts."""
        self._settings, self._progress = settings, progress
        self._stopping = False
        specs = settings.engine_specs()
        self.mps = plan_mps(specs, mode=settings.launch.mps, log_dir=settings.engine_log_dir)
        self.engines = _plan_engines(settings, specs, model_path=model_path, layout=layout, mps=self.mps)

    async def start_all(self, session: aiohttp.ClientSession) -> None:
        """Start the MPS daemon if planned, then every engine at once, and wait until all are
        ready; on any failure stop all.
        """
        await self._check_backends_load()
        if self.mps is not None:
            await self.mps.start()
            self._progress(f"  {'mps':<10} started  engines sharing a GPU run side by side ({self.mps.pipe_dir})")
        for engine in self.engines:
            await engine.start()
            self._progress(f"  {engine.spec.name:<10} started  pid {engine.pid}, log {engine.log_path}")
        try:
            await asyncio.gather(*(self._wait_ready(engine, session) for engine in self.engines))
        except BaseException:
            await self.stop_all()
            raise

    async def _check_backends_load(self) -> None:
        """UCX ships inside NIXL's wheel; other backends need system libraries: refuse before any engine
        starts if NIXL cannot create them, naming the library it could not load."""
        extra = [backend for backend in self._settings.kv.backends if backend != "UCX"]
        if not extra or not self.engines:
            return
        problems = await backend_problems(extra, python=self._settings.launch.python or sys.executable,
                                          env=self.engines[0].command.env)
        if problems:
            raise EngineStartFailed("NIXL cannot create the KV backend(s) in kv.backends: " + "; ".join(
                f"{backend}: {why}" for backend, why in problems.items()) + " (see docs/transport.md, section 9)")

    async def keep_alive(self, session: aiohttp.ClientSession) -> None:
        """Run until cancelled: restart engines that exit, with doubling backoff.

        Raises EngineStartFailed once an engine has used up ``launch.max_restarts``.
        """
        restarts = dict.fromkeys((engine.spec.name for engine in self.engines), 0)
        async with asyncio.TaskGroup() as group:
            for engine in self.engines:
                group.create_task(self._keep_one(engine, session, restarts))

    async def _keep_one(self, engine: EngineProcess, session: aiohttp.ClientSession, restarts: dict[str, int]) -> None:
        launch = self._settings.launch
        while True:
            code = await engine.wait_exit()
            if self._stopping:
                return
            name = engine.spec.name
            if restarts[name] >= launch.max_restarts:
                raise EngineStartFailed(f"{name} died (exit {code}) {restarts[name]} times; giving up:\n{engine.log_tail()}")
            delay_s = launch.restart_backoff_s * 2 ** restarts[name]
            restarts[name] += 1
            log.error("%s DIED with exit code %s; restart %d/%d in %.0f s. Log tail:\n%s",
                      name, code, restarts[name], launch.max_restarts, delay_s, engine.log_tail())
            await asyncio.sleep(delay_s)
            await engine.stop()
            await engine.start()
            await self._wait_ready(engine, session)

    async def _wait_ready(self, engine: EngineProcess, session: aiohttp.ClientSession) -> None:
        await bring_up(engine, session, timeout_s=self._settings.launch.ready_timeout_s, progress=self._progress)

    async def stop_all(self) -> None:
        self._stopping = True
        await asyncio.gather(*(engine.stop() for engine in self.engines))
        if self.mps is not None:
            await self.mps.stop()


def _plan_engines(
    settings: Settings, specs: list[EngineSpec], *, model_path: str, layout: ModelLayout, mps: MpsDaemon | None
) -> list[EngineProcess]:
    cpu_specs = [spec for spec in specs if spec.pool.device == "cpu"]
    auto_binds = iter(split_cpus(sorted(os.sched_getaffinity(0)), len(cpu_specs)))
    log_dir = settings.engine_log_dir
    link = probe_host_link()
    engines = []
    for spec in specs:
        cpu_bind = spec.cpu_threads_bind or (next(auto_binds) if spec.pool.device == "cpu" else "")
        command = build_engine_command(
            spec, model=settings.model, model_path=model_path, layout=layout, kv=settings.kv,
            python=settings.launch.python or sys.executable, host=settings.launch.engine_host, cpu_bind=cpu_bind,
            link=link, otlp_traces_endpoint=settings.gateway.otlp_traces_endpoint,
        )
        if mps is not None and mps.serves(spec):
            command = replace(command, env=command.env | mps.env)
        engines.append(EngineProcess(spec, command, log_path=log_dir / f"{spec.name}.log"))
    return engines

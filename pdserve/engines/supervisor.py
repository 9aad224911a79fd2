"""Keep the engines alive: start them together, restart one that dies, add or drain engines
when an admin scales a pool (`pdserve scale`), stop all.

What runs is published to the gateway through the members file (engines/members.py): an added
engine joins the gateway's pool once it answers, a removed one leaves it before it drains.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import sys
import time
from collections.abc import Callable
from dataclasses import replace

import aiohttp

from pdserve.config import Settings
from pdserve.engine_config import EngineSpec
from pdserve.engine_key import EngineKey
from pdserve.engines.command import CPU_BIND_ENV, build_engine_command, split_cpus
from pdserve.engines.drain import wait_until_idle
from pdserve.engines.kv_link import probe_host_link
from pdserve.engines.launcher import EngineProcess, bring_up, busy_ports
from pdserve.engines.members import EngineState, Member, Members, MembersFolder
from pdserve.engines.model_layout import ModelLayout
from pdserve.engines.mps import plan_mps
from pdserve.engines.nixl_plugins import backend_problems
from pdserve.errors import EngineStartFailed
from pdserve.role import Role

log = logging.getLogger(__name__)
SCALE_LOOK_INTERVAL_S = 0.25  # how often a scale request is looked for


class Supervisor:
    def __init__(
        self, settings: Settings, *, model_path: str, layout: ModelLayout, progress: Callable[[str], None],
        engine_key: EngineKey, gpu_memory_bytes: int | None = None,
    ) -> None:
        """Plans every engine's command, so a model the pools cannot hand off is refused (ConfigError)
        before any engine starts. ``engine_key``: the deployment's (engine_key.py), which every engine requires, so
        the sessions given to this supervisor must carry it. ``gpu_memory_bytes``: this host's GPU (None = unknown),
        which bounds a hybrid model's batch (engines/batch_size.py)."""
        self._settings, self._progress, self._gpu_memory_bytes = settings, progress, gpu_memory_bytes
        self._engine_key = engine_key
        self._model_path, self._layout, self._link = model_path, layout, probe_host_link()
        self._stopping = False
        specs = settings.engine_specs()
        self.mps = plan_mps(specs, mode=settings.launch.mps, log_dir=settings.engine_log_dir)
        cpu_binds = iter(split_cpus(sorted(os.sched_getaffinity(0)), sum(spec.pool.device == "cpu" for spec in specs)))
        self.engines = [self._plan(new_instance(spec), cpu_bind=next(cpu_binds) if spec.pool.device == "cpu" else "")
                        for spec in specs]
        self.members = MembersFolder(settings.run_dir)
        self.members.clear()  # a previous run's request must not resize this one
        self._states = {engine.spec.name: EngineState.STARTING for engine in self.engines}
        self._wanted = {role: settings.pool(role).engines for role in Role}
        self._retired: set[EngineProcess] = set()  # stopped on purpose: not restarted (a later one may share its name)
        self._restarts: dict[str, int] = {}
        self._group: asyncio.TaskGroup | None = None

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
        self._states = dict.fromkeys(self._states, EngineState.SERVING)
        self._publish()

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
        """Run until cancelled: restart engines that exit, with doubling backoff, and carry out
        scale requests.

        Raises EngineStartFailed once an engine has used up ``launch.max_restarts``.
        """
        async with asyncio.TaskGroup() as group:
            self._group = group
            for engine in self.engines:
                group.create_task(self._keep_one(engine, session))
            group.create_task(self._follow_scale_requests(session))

    async def _keep_one(self, engine: EngineProcess, session: aiohttp.ClientSession) -> None:
        launch, name = self._settings.launch, engine.spec.name
        while True:
            code = await engine.wait_exit()
            if self._stopping or engine in self._retired:
                return
            restarts = self._restarts.get(name, 0)
            if restarts >= launch.max_restarts:
                raise EngineStartFailed(engine.failure(f"died (exit {code}) {restarts} times; giving up"))
            delay_s = launch.restart_backoff_s * 2 ** restarts
            self._restarts[name] = restarts + 1
            log.error("%s", engine.failure(f"DIED with exit code {code}; restart {restarts + 1}/"
                                           f"{launch.max_restarts} in {delay_s:.0f} s"))
            await asyncio.sleep(delay_s)
            await engine.stop()
            # A new NIXL engine id: decode engines must not pull with the dead one's handshake.
            fresh = self._plan(new_instance(engine.spec), cpu_bind=engine.command.env.get(CPU_BIND_ENV, ""))
            engine.renew(fresh.spec, fresh.command)
            await engine.start()
            await self._wait_ready(engine, session)

    async def _follow_scale_requests(self, session: aiohttp.ClientSession) -> None:
        while True:
            if (wanted := self.members.take_request()) is not None:
                self.scale(wanted, session)
            await asyncio.sleep(SCALE_LOOK_INTERVAL_S)

    def scale(self, wanted: dict[Role, int], session: aiohttp.ClientSession) -> None:
        """Start engines where a pool has fewer than ``wanted``, drain the newest where it has more."""
        assert self._group is not None, "scale() runs under keep_alive()"
        for role, count in wanted.items():
            self._wanted[role] = count
            staying = sorted((engine for engine in self.engines if engine.spec.role is role
                              and self._states[engine.spec.name] is not EngineState.DRAINING),
                             key=lambda engine: engine.spec.index)
            for engine in staying[count:]:
                self._group.create_task(self._drain(engine, session))
            for _ in range(count - len(staying)):
                engine = self._plan_added(role)
                self.engines.append(engine)  # before the next is planned: each takes its own index and ports
                self._restarts.pop(engine.spec.name, None)  # a new engine, whatever one of its name did before
                self._states[engine.spec.name] = EngineState.STARTING
                self._group.create_task(self._add(engine, session))
        self._publish()

    async def _add(self, engine: EngineProcess, session: aiohttp.ClientSession) -> None:
        """Start one more engine (planned by ``scale``); it joins the gateway's pool once it answers.
        A failed start is reported and leaves the pool as it was: the deployment keeps serving."""
        name = engine.spec.name
        try:
            if busy := busy_ports([engine.spec.port, engine.spec.side_channel_port]):
                raise EngineStartFailed(f"ports already in use: {busy}")
            await engine.start()
            self._progress(f"  {name:<10} started  pid {engine.pid}, log {engine.log_path}")
            await self._wait_ready(engine, session)
        except EngineStartFailed as exc:
            if engine in self._retired:  # scaled down while it started: _drain stopped and dropped it
                return
            log.error("scaling up: %s did not start, so the %s pool stays smaller than asked: %s",
                      name, engine.spec.role.value, exc)
            await self._forget(engine)
            return
        self._states[name] = EngineState.SERVING
        self._publish()
        await self._keep_one(engine, session)

    async def _drain(self, engine: EngineProcess, session: aiohttp.ClientSession) -> None:
        """Take ``engine`` out of the gateway's pool, let what it runs finish (engines/drain.py), then
        stop it. Past ``launch.drain_timeout_s`` it is stopped anyway."""
        name, started_s = engine.spec.name, time.monotonic()
        was_starting = self._states[name] is EngineState.STARTING
        self._states[name] = EngineState.DRAINING
        self._publish()
        if not was_starting:
            self._progress(f"  {name:<10} draining (out of the gateway's pool; running requests finish)")
            if not await wait_until_idle(session, engine.spec.base_url, is_running=lambda: engine.is_running,
                                         timeout_s=self._settings.launch.drain_timeout_s,
                                         read_timeout_s=self._settings.gateway.health_timeout_s):
                log.warning("%s still busy after launch.drain_timeout_s (%.0f s): stopping it anyway",
                            name, self._settings.launch.drain_timeout_s)
        await self._forget(engine)
        self._progress(f"  {name:<10} stopped  drained in {time.monotonic() - started_s:.1f}s")

    async def _forget(self, engine: EngineProcess) -> None:
        """Stop ``engine`` for good and drop it from what is published."""
        self._retired.add(engine)
        await engine.stop()
        self.engines.remove(engine)
        self._states.pop(engine.spec.name, None)
        self._publish()

    def _plan_added(self, role: Role) -> EngineProcess:
        """The next engine of ``role``: the lowest index and side-channel port no engine holds,
        and, on CPU, its share of this host's cores as if the pools had been configured this size
        (the running engines keep theirs)."""
        taken = {engine.spec.index for engine in self.engines if engine.spec.role is role}
        index = next(index for index in range(len(taken) + 1) if index not in taken)
        side_ports = {engine.spec.side_channel_port for engine in self.engines}
        side_port = next(port for port in range(self._settings.kv.side_channel_base_port, 65536)
                         if port not in side_ports)
        spec = new_instance(self._settings.engine_spec(role, index, side_channel_port=side_port))
        cpu_bind = ""
        if spec.pool.device == "cpu" and not spec.cpu_threads_bind:
            cpu_engines = sum(engine.spec.pool.device == "cpu" for engine in self.engines)
            cpu_bind = split_cpus(sorted(os.sched_getaffinity(0)), cpu_engines + 1)[cpu_engines]
        return self._plan(spec, cpu_bind=cpu_bind)

    def _plan(self, spec: EngineSpec, *, cpu_bind: str) -> EngineProcess:
        settings = self._settings
        command = build_engine_command(
            spec, model=settings.model, model_path=self._model_path, layout=self._layout, kv=settings.kv,
            python=settings.launch.python or sys.executable, host=settings.launch.engine_host,
            cpu_bind=spec.cpu_threads_bind or cpu_bind, link=self._link,
            otlp_traces_endpoint=settings.gateway.otlp_traces_endpoint, compile_cache_dir=settings.launch.cache_dir,
            gpu_memory_bytes=self._gpu_memory_bytes, engine_key=self._engine_key,
        )
        if self.mps is not None and self.mps.serves(spec):
            command = replace(command, env=command.env | self.mps.env)
        return EngineProcess(spec, command, log_path=settings.engine_log_dir / f"{spec.name}.log")

    def _publish(self) -> None:
        self.members.write(Members(
            engines=tuple(Member(name=engine.spec.name, role=engine.spec.role, url=engine.spec.base_url,
                                 state=self._states[engine.spec.name], log_path=str(engine.log_path))
                          for engine in self.engines),
            wanted=dict(self._wanted)))

    async def _wait_ready(self, engine: EngineProcess, session: aiohttp.ClientSession) -> None:
        await bring_up(engine, session, timeout_s=self._settings.launch.ready_timeout_s, progress=self._progress)

    async def stop_all(self) -> None:
        self._stopping = True
        await asyncio.gather(*(engine.stop() for engine in self.engines))
        if self.mps is not None:
            await self.mps.stop()
        self.members.clear()


def new_instance(spec: EngineSpec) -> EngineSpec:
    """``spec`` as an engine never started before: its NIXL engine id (engine_config.py) is new at each start, so a
    decode engine that cached the handshake of the engine it replaces (vLLM keys it by engine id) makes a
    new one, rather than reading from the dead engine's agent (a pull that fails, and a pair ejected)."""
    return spec.model_copy(update={"instance": f"{spec.index}-{secrets.token_hex(4)}"})

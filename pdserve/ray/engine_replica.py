"""One Ray Serve replica runs one vLLM engine on the node Ray placed it on, bound to that node's
address (NIXL side channel and ``VLLM_HOST_IP`` included). Serve's health check asks the
engine's ``/health``; each healthy answer also renews the engine's registration with the
engine registry, which every gateway replica copies, so a replica Serve replaces or adds is used within seconds.

Replacing an engine costs a full start (a minute on CPU, minutes on a GPU), so a running engine
that misses probes is given ``ray.engine_unresponsive_s`` before Serve is told: a busy CPU engine
can stall for seconds while a neighbour compiles. One that has exited fails at once.

The replica also reports its engine's load for Serve's autoscaling policy (autoscaling.py), and
when Serve stops it (scale-down included) it lets the engine finish what it holds first."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
from typing import Any

import ray
from ray import serve
from ray.exceptions import RayError
from ray.serve.exceptions import RayServeException

from pdserve.config import Settings, parse_settings
from pdserve.engine_config import EngineSpec
from pdserve.engine_key import EngineKey, engine_session
from pdserve.engines.command import EngineCommand, build_engine_command, split_cpus
from pdserve.engines.drain import read_load, wait_until_idle
from pdserve.engines.host_checks import check_engine_host, gpu_memory_bytes, read_memlock_limit
from pdserve.engines.kv_link import probe_host_link
from pdserve.engines.kv_path import KvPathLog
from pdserve.engines.launcher import EngineProcess, bring_up
from pdserve.engines.vllm_version import checked_launch
from pdserve.errors import EngineStartFailed
from pdserve.ray.deployment_key import GcsKeyStore, application_engine_key
from pdserve.ray.names import REGISTRY_DEPLOYMENT
from pdserve.ray.node_address import has_outgrown, replica_bind_host
from pdserve.ray.pool_size import report_stats
from pdserve.role import Role
from pdserve.routing.health import probe
from pdserve.up import resolve_layout, resolve_model

log = logging.getLogger(__name__)
ANNOUNCE_TIMEOUT_S = 5.0
ENGINE_STOP_S = 20.0  # from SIGTERM to SIGKILL
STOP_MARGIN_S = 5.0


def stop_budget_s(*, drain_timeout_s: float) -> float:
    """How long Serve must give a stopping replica: leave the gateways, drain, stop the engine."""
    return ANNOUNCE_TIMEOUT_S + drain_timeout_s + ENGINE_STOP_S + STOP_MARGIN_S


class EngineReplica:
    async def __init__(self, args: dict[str, Any], role: str) -> None:  # type: ignore[misc]  # Serve awaits it
        settings = parse_settings(args, source="Serve application args")
        context = serve.get_replica_context()
        self._role = Role(role)
        rank, local_rank = replica_ranks(context.rank)
        self._spec = replica_engine_spec(settings, self._role, host=await replica_bind_host(),
                                         rank=rank, local_rank=local_rank, instance=context.replica_id.unique_id,
                                         gpu_ids=[int(gpu) for gpu in ray.get_gpu_ids()])
        engine_key = await application_engine_key(settings, app_name=context.app_name, store=GcsKeyStore())
        command = await plan_engine(settings, self._spec, local_rank=local_rank, engine_key=engine_key)
        log_path = settings.engine_log_dir.resolve() / f"{self._spec.name}-{self._spec.instance}.log"
        self._engine = EngineProcess(self._spec, command, log_path=log_path)
        self._kv_path_log = KvPathLog(log_path)  # the engine may run on another node than `pdserve verify`
        self._session = engine_session(engine_key)  # /metrics (load, drain) needs the key; /health does not
        self._health_timeout_s = settings.gateway.health_timeout_s
        self._drain_timeout_s = settings.ray.drain_timeout_s
        self._unanswered = Unanswered(grace_s=settings.ray.engine_unresponsive_s)
        self._announcing: asyncio.Task[None] | None = None
        self._registry = serve.get_deployment_handle(REGISTRY_DEPLOYMENT, app_name=context.app_name)
        log.info("starting %s at %s (log %s)", self._spec.name, self._spec.base_url, log_path)
        await self._engine.start()
        try:
            await bring_up(self._engine, self._session, timeout_s=settings.launch.ready_timeout_s, progress=log.info)
        except BaseException:
            await self._stop()
            raise
        await self._announce()

    async def check_health(self) -> None:
        """Raises when the engine has exited or not answered for ``ray.engine_unresponsive_s``:
        Serve then replaces this replica. Registration runs beside it, so a busy
        registry never fails an engine's health check."""
        if not self._engine.is_running:
            failure = self._engine.failure("exited")
            await self._engine.stop()  # its EngineCore and workers outlive a killed API server otherwise
            raise EngineStartFailed(failure)
        if await has_outgrown(self._spec.host):
            # Serve stops this replica as it stops any (__del__: the engine's streams end first) and starts one
            # on the node's address, which the other machine's gateways and engines can reach.
            raise EngineStartFailed(f"{self._spec.name} listens on loopback, but a node of another machine has "
                                    "joined the cluster: it moves to its node's address")
        problem = await probe(self._session, self._spec.base_url, timeout_s=self._health_timeout_s)
        verdict = self._unanswered.verdict(problem, now_s=time.monotonic())
        if verdict is not None:
            # Serve replaces this replica; an engine that stopped answering has nothing left to drain.
            await self._engine.stop(grace_s=ENGINE_STOP_S)
            raise EngineStartFailed(f"{self._spec.name} at {self._spec.base_url} is unhealthy: {verdict}")
        if problem is not None:
            log.warning("%s at %s missed a health probe (%s); still running", self._spec.name, self._spec.base_url,
                        problem)
        elif self._announcing is None or self._announcing.done():
            self._announcing = asyncio.create_task(self._announce())

    def engine_url(self) -> str:
        return self._spec.base_url

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve calls this (only with autoscaling on) for the pool's policy: the engine's load now.
        A failed read raises; Serve logs it and skips the point."""
        return report_stats(await read_load(self._session, self._spec.base_url, timeout_s=self._health_timeout_s))

    async def _announce(self) -> None:
        """Tell the engine registry, and so every gateway, that this engine serves; never fails the
        health check over it."""
        try:
            await asyncio.wait_for(self._registry.register.remote(self._role.value, self._spec.base_url,
                                                                 self._kv_path_log.read()), timeout=ANNOUNCE_TIMEOUT_S)
        except (TimeoutError, RayError, RayServeException) as exc:
            log.warning("could not register %s with the engine registry yet: %r", self._spec.base_url, exc)

    async def __del__(self) -> None:
        """Serve stops this replica (scale-down, replacement, teardown) within stop_budget_s."""
        await self._unregister()
        await self._drain()
        await self._stop()

    async def _unregister(self) -> None:
        """First, so that no new request is sent to an engine that is going away."""
        if self._announcing is not None:
            self._announcing.cancel()
        with contextlib.suppress(TimeoutError, RayError, RayServeException):
            await asyncio.wait_for(self._registry.unregister.remote(self._role.value, self._spec.base_url),
                                   timeout=ANNOUNCE_TIMEOUT_S)

    async def _drain(self) -> None:
        """Let the engine finish its streams, and a prefill engine its handoffs, before it stops."""
        is_drained = await wait_until_idle(self._session, self._spec.base_url, timeout_s=self._drain_timeout_s,
                                           is_running=lambda: self._engine.is_running,
                                           read_timeout_s=self._health_timeout_s)
        if not is_drained:
            log.warning("%s still busy after ray.drain_timeout_s (%.0f s); stopping it anyway",
                        self._spec.name, self._drain_timeout_s)

    async def _stop(self) -> None:
        await self._engine.stop(grace_s=ENGINE_STOP_S)
        await self._session.close()


async def plan_engine(settings: Settings, spec: EngineSpec, *, local_rank: int, engine_key: EngineKey) -> EngineCommand:
    """The command of this replica's engine, once this node is found fit to run it: raises the version gate's
    line (engines/vllm_version.py) or the preflight's one PREFLIGHT_PREFIX line (Serve's message, `cloud status`)
    before vLLM runs."""
    python = settings.launch.python or sys.executable
    await checked_launch(settings, python)  # this node's vLLM, in pdserve's range, before a model is fetched
    cpu_bind = replica_cpu_bind(spec.pool.cpu_threads_bind, local_rank=local_rank, cpus=sorted(os.sched_getaffinity(0)))
    model_path = await resolve_model(settings, progress=log.info)
    layout = await resolve_layout(model_path, progress=log.info)
    link = probe_host_link()
    command = build_engine_command(
        spec, model=settings.model, model_path=model_path, layout=layout, kv=settings.kv,
        python=python, host=spec.host, cpu_bind=cpu_bind,
        link=link, otlp_traces_endpoint=settings.gateway.otlp_traces_endpoint,
        compile_cache_dir=settings.launch.cache_dir,
        gpu_memory_bytes=await gpu_memory_bytes([spec.pool]), engine_key=engine_key,
    )
    checked = await check_engine_host(spec.pool, kv=settings.kv, env=command.env, link=link, python=python,
                                      memlock_limit_bytes=read_memlock_limit())
    log.info("preflight ok: %s", checked)
    return command


class Unanswered:
    """How long an engine has gone without a healthy answer; a verdict once that passes the grace."""

    def __init__(self, *, grace_s: float) -> None:
        self._grace_s = grace_s
        self._since_s: float | None = None

    def verdict(self, problem: str | None, *, now_s: float) -> str | None:
        """None while the engine answered, or has not for at most the grace; else why it is unhealthy."""
        if problem is None:
            self._since_s = None
            return None
        if self._since_s is None:
            self._since_s = now_s
        silent_s = now_s - self._since_s
        return f"{problem}, no healthy answer for {silent_s:.0f} s" if silent_s > self._grace_s else None


def replica_engine_spec(
    settings: Settings, role: Role, *, host: str, rank: int, local_rank: int, instance: str, gpu_ids: list[int]
) -> EngineSpec:
    """The engine of one replica: the pool's settings on this node's address, and ports that stay
    the same every time this rank starts on this node where they are free: the API port
    ``base_port + local_rank`` (on Kubernetes, the worker pod's named port that Prometheus
    scrapes), and the NIXL side-channel port (vLLM keys its compile cache on it, and a new one
    costs a full compile)."""
    pool = settings.pool(role)
    side_channel_port = settings.kv.side_channel_base_port + 2 * local_rank + (role is Role.DECODE)
    return EngineSpec(
        role=role, index=rank, port=port_if_free(host, pool.base_port + local_rank),
        side_channel_port=port_if_free(host, side_channel_port),
        gpu_ids=gpu_ids, cpu_threads_bind="", pool=pool, host=host, instance=instance,
    )


def replica_ranks(rank: Any) -> tuple[int, int]:
    """(rank in the deployment, rank on this node). Serve marks replica ranks experimental: newer
    Ray gives a ReplicaRank, older Ray a bare int (then the node rank is taken as 0)."""
    if isinstance(rank, int):
        return rank, 0
    return int(rank.rank), int(rank.local_rank)


def replica_cpu_bind(configured: list[str], *, local_rank: int, cpus: list[int]) -> str:
    """Cores for a CPU engine: the pool's list by the replica's rank on its node, else the node's."""
    return configured[local_rank % len(configured)] if configured else split_cpus(cpus, 1)[0]


def port_if_free(host: str, port: int) -> int:
    """``port`` if nothing on ``host`` listens on it, else one the kernel picks."""
    with socket.socket() as probe_socket:
        try:
            probe_socket.bind((host, port))
        except OSError:
            log.warning("port %s:%d is taken; using another (a new side-channel port means a fresh compile)",
                        host, port)
            return free_port(host)
        return port


def free_port(host: str) -> int:
    """A port nothing on ``host`` listens on now (the kernel's pick)."""
    with socket.socket() as probe_socket:
        probe_socket.bind((host, 0))
        port: int = probe_socket.getsockname()[1]
        return port

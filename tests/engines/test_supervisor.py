"""The supervisor with real child processes (a 10-line HTTP server standing in for vLLM)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import aiohttp
import pytest

from pdserve.config import parse_settings
from pdserve.engine_config import EngineSpec
from pdserve.engine_key import EngineKey
from pdserve.engines.command import EngineCommand
from pdserve.engines.launcher import EngineProcess
from pdserve.engines.model_layout import Layout, ModelLayout
from pdserve.engines.supervisor import Supervisor
from pdserve.errors import EngineStartFailed
from pdserve.role import Role
from pdserve_vllm import ENGINE_KEY_ENV
from tests.conftest import free_port_block

# /metrics says as many running requests as the file named by its second argument holds (0 if none);
# it starts listening only after the seconds its ".slow" sibling holds, if there is one.
FAKE_ENGINE = """
import http.server, pathlib, sys, time
busy = pathlib.Path(sys.argv[2])
slow = busy.with_suffix(".slow")
time.sleep(float(slow.read_text()) if slow.exists() else 0)
class Engine(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        running = busy.read_text() if busy.exists() else "0"
        body = f'vllm:num_requests_running{{engine="0"}} {running}\\n'.encode() if self.path == "/metrics" else b""
        self.send_response(200 if self.path in ("/health", "/metrics") else 404); self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Engine).serve_forever()
"""


class FakeEngines(Supervisor):
    """Plans a 10-line HTTP server for every engine, those a scale adds included; engine NAME is
    busy while ``<log_dir>/NAME.busy`` holds a count above 0, and slow to start by the seconds
    ``<log_dir>/NAME.slow`` holds."""

    def _plan(self, spec: EngineSpec, *, cpu_bind: str) -> EngineProcess:
        log_dir = self._settings.engine_log_dir
        command = EngineCommand([sys.executable, "-c", FAKE_ENGINE, str(spec.port), str(log_dir / f"{spec.name}.busy")], {})
        return EngineProcess(spec, command, log_path=log_dir / f"{spec.name}.log")


def supervisor_with_fake_engines(tmp_path: Path) -> Supervisor:
    base = free_port_block(8)
    settings = parse_settings({
        "prefill": {"base_port": base}, "decode": {"base_port": base + 1},
        "kv": {"side_channel_base_port": base + 4}, "gateway": {"port": base + 7},
        "launch": {"log_dir": str(tmp_path), "ready_timeout_s": 20, "restart_backoff_s": 0.1, "max_restarts": 1,
                   "drain_timeout_s": 30},
    }, source="test")
    layout = ModelLayout("unused", Layout.ATTENTION, "test")
    return FakeEngines(settings, model_path="unused", layout=layout, progress=lambda _line: None,
                       engine_key=EngineKey("unused-engine-key-0123"))


async def test_an_engine_starts_with_the_deployment_key_and_none_of_the_gateways_keys(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As `pdserve up` plans and starts it, with its argv swapped for a process that prints its environment."""
    monkeypatch.setenv("PDSERVE_API_KEYS", "client-key-0123456789")
    monkeypatch.setenv("PDSERVE_ADMIN_KEY", "admin-key-0123456789")
    key = EngineKey("deployment-key-0123456789")
    settings = parse_settings({"launch": {"log_dir": str(tmp_path)}}, source="test")
    planned = Supervisor(settings, model_path="m", layout=ModelLayout("m", Layout.ATTENTION, "test"),
                         progress=lambda _line: None, engine_key=key).engines[0]
    printing = [sys.executable, "-c", "import json, os; print('ENV ' + json.dumps(dict(os.environ)))"]
    engine = EngineProcess(planned.spec, replace(planned.command, argv=printing), log_path=planned.log_path)
    await engine.start()
    assert await engine.wait_exit() == 0
    await engine.stop()
    (line,) = [line for line in engine.log_path.read_text().splitlines() if line.startswith("ENV ")]
    env = json.loads(line.removeprefix("ENV "))
    assert env[ENGINE_KEY_ENV] == env["VLLM_API_KEY"] == key.value
    assert "PDSERVE_API_KEYS" not in env and "PDSERVE_ADMIN_KEY" not in env


async def test_dead_engine_is_restarted_and_everything_stops(tmp_path: Path) -> None:
    supervisor = supervisor_with_fake_engines(tmp_path)
    async with aiohttp.ClientSession() as session:
        await supervisor.start_all(session)
        keeper = asyncio.create_task(supervisor.keep_alive(session))
        decode = supervisor.engines[1]
        first_pid = decode.pid
        assert first_pid is not None
        os.kill(first_pid, signal.SIGKILL)
        assert await answers_health(session, decode.spec.base_url, within_s=10)
        assert decode.pid != first_pid and decode.is_running
        pids = [engine.pid for engine in supervisor.engines]
        await supervisor.stop_all()
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
    for pid in pids:
        assert pid is not None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


async def answers_health(session: aiohttp.ClientSession, url: str, *, within_s: float) -> bool:
    for _ in range(int(within_s / 0.1)):
        await asyncio.sleep(0.1)
        try:
            async with session.get(f"{url}/health") as reply:
                if reply.status == 200:
                    return True
        except aiohttp.ClientError:
            continue
    return False


async def test_engine_that_cannot_start_fails_loudly_with_its_log(tmp_path: Path) -> None:
    supervisor = supervisor_with_fake_engines(tmp_path)
    broken = supervisor.engines[0]
    supervisor.engines[0] = EngineProcess(
        broken.spec, EngineCommand([sys.executable, "-c", "raise SystemExit('no GPU found')"], {}), log_path=broken.log_path
    )
    async with aiohttp.ClientSession() as session:
        with pytest.raises(EngineStartFailed, match="no GPU found"):
            await supervisor.start_all(session)
    assert not any(engine.is_running for engine in supervisor.engines)


async def until(check: Callable[[], bool], *, within_s: float) -> bool:
    for _ in range(int(within_s / 0.1)):
        if check():
            return True
        await asyncio.sleep(0.1)
    return check()


def states(supervisor: Supervisor) -> dict[str, str]:
    members = supervisor.members.read()
    assert members is not None
    return {member.name: member.state.value for member in members.engines}


async def test_scale_up_joins_once_ready_and_scale_down_drains_the_newest_until_it_is_idle(tmp_path: Path) -> None:
    supervisor = supervisor_with_fake_engines(tmp_path)
    async with aiohttp.ClientSession() as session:
        await supervisor.start_all(session)
        keeper = asyncio.create_task(supervisor.keep_alive(session))
        assert states(supervisor) == {"prefill-0": "serving", "decode-0": "serving"}

        supervisor.members.request_scale({Role.PREFILL: 1, Role.DECODE: 2})  # as the gateway's /admin/scale does
        assert await until(lambda: states(supervisor).get("decode-1") == "starting", within_s=5)
        assert await until(lambda: states(supervisor).get("decode-1") == "serving", within_s=20)
        added = next(engine for engine in supervisor.engines if engine.spec.name == "decode-1")
        assert added.spec.port == supervisor.engines[1].spec.port + 1
        assert await answers_health(session, added.spec.base_url, within_s=5)

        (tmp_path / "decode-1.busy").write_text("1")  # one request still running there
        supervisor.members.request_scale({Role.PREFILL: 1, Role.DECODE: 1})
        assert await until(lambda: states(supervisor).get("decode-1") == "draining", within_s=5)
        await asyncio.sleep(2)
        assert states(supervisor).get("decode-1") == "draining" and added.is_running  # waits for its request
        (tmp_path / "decode-1.busy").write_text("0")
        assert await until(lambda: "decode-1" not in states(supervisor), within_s=10)
        assert not added.is_running and states(supervisor) == {"prefill-0": "serving", "decode-0": "serving"}
        assert not keeper.done()  # an engine stopped on purpose is not restarted, nor an error

        supervisor.members.request_scale({Role.PREFILL: 1, Role.DECODE: 2})  # back, under the same name
        assert await until(lambda: states(supervisor).get("decode-1") == "serving", within_s=20)
        again = next(engine for engine in supervisor.engines if engine.spec.name == "decode-1")
        first_pid = again.pid
        assert first_pid is not None and again is not added
        os.kill(first_pid, signal.SIGKILL)  # the new one is kept alive like any other
        assert await until(lambda: again.pid != first_pid and again.is_running, within_s=10)
        assert await answers_health(session, again.spec.base_url, within_s=10)
        await supervisor.stop_all()
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)
    assert supervisor.members.read() is None


async def test_engines_added_at_once_take_their_own_ports_and_one_drained_while_starting_just_goes(
        tmp_path: Path) -> None:
    supervisor = supervisor_with_fake_engines(tmp_path)
    (tmp_path / "decode-2.slow").write_text("30")  # still starting when it is scaled away
    async with aiohttp.ClientSession() as session:
        await supervisor.start_all(session)
        keeper = asyncio.create_task(supervisor.keep_alive(session))
        supervisor.members.request_scale({Role.PREFILL: 1, Role.DECODE: 3})
        assert await until(lambda: states(supervisor).get("decode-1") == "serving", within_s=20)
        assert states(supervisor)["decode-2"] == "starting"
        ports = [(engine.spec.port, engine.spec.side_channel_port) for engine in supervisor.engines]
        assert len(set(ports)) == len(ports) == 4, ports

        supervisor.members.request_scale({Role.PREFILL: 1, Role.DECODE: 2})  # the newest goes: still starting
        assert await until(lambda: "decode-2" not in states(supervisor), within_s=10)
        await asyncio.sleep(1)
        assert not keeper.done(), keeper  # its start failing, as it was stopped, is no error
        assert states(supervisor) == {"prefill-0": "serving", "decode-0": "serving", "decode-1": "serving"}
        await supervisor.stop_all()
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)


async def test_a_restarted_engine_is_a_new_nixl_engine(tmp_path: Path) -> None:
    """vLLM's decode side keys the handshakes it caches by engine id: one kept across a restart is
    pulled from through the dead engine's agent (seen on the bed of hosts: a failed pull, the pair ejected)."""
    supervisor = supervisor_with_fake_engines(tmp_path)
    async with aiohttp.ClientSession() as session:
        await supervisor.start_all(session)
        keeper = asyncio.create_task(supervisor.keep_alive(session))
        prefill = supervisor.engines[0]
        first_id, first_pid, first_url = prefill.spec.engine_id, prefill.pid, prefill.spec.base_url
        assert first_pid is not None and first_id.startswith("pdserve-prefill-0-")
        assert len({engine.spec.engine_id for engine in supervisor.engines}) == len(supervisor.engines)
        os.kill(first_pid, signal.SIGKILL)
        assert await answers_health(session, prefill.spec.base_url, within_s=10)
        assert prefill.pid != first_pid and prefill.spec.engine_id.startswith("pdserve-prefill-0-")
        assert prefill.spec.engine_id != first_id and prefill.spec.base_url == first_url  # the same address
        await supervisor.stop_all()
        keeper.cancel()
        await asyncio.gather(keeper, return_exceptions=True)

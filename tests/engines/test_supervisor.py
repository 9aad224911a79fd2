"""The supervisor with real child processes (a 10-line HTTP server standing in for vLLM)."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import aiohttp
import pytest

from pdserve.config import parse_settings
from pdserve.engines.command import EngineCommand
from pdserve.engines.launcher import EngineProcess
from pdserve.engines.model_layout import Layout, ModelLayout
from pdserve.engines.supervisor import Supervisor
from pdserve.errors import EngineStartFailed
from tests.conftest import free_port_block

FAKE_ENGINE = """
import http.server, sys
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def log_message(self, *args): pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
"""


def supervisor_with_fake_engines(tmp_path: Path, *, argv_tail: list[str] | None = None) -> Supervisor:
    base = free_port_block(5)
    settings = parse_settings({
        "prefill": {"base_port": base}, "decode": {"base_port": base + 1},
        "kv": {"side_channel_base_port": base + 2}, "gateway": {"port": base + 4},
        "launch": {"log_dir": str(tmp_path), "ready_timeout_s": 20, "restart_backoff_s": 0.1, "max_restarts": 1},
    }, source="test")
    layout = ModelLayout("unused", Layout.ATTENTION, "test")
    supervisor = Supervisor(settings, model_path="unused", layout=layout, progress=lambda _line: None)
    supervisor.engines = [
        EngineProcess(engine.spec, EngineCommand([sys.executable, "-c", FAKE_ENGINE, str(engine.spec.port), *(argv_tail or [])], {}),
                      log_path=engine.log_path)
        for engine in supervisor.engines
    ]
    return supervisor


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

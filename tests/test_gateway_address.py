"""`status`, `scale` and `verify` find the gateway `pdserve up` serves (its --port included), and say in one
line what they tried when none answers, or that the gateway wants the admin key; a record naming a gateway
neither this config's nor on loopback is refused (the admin key goes there), and the record is 0600."""

from __future__ import annotations

import asyncio
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.access import ADMIN_KEY_ENV, API_KEYS_ENV
from pdserve.config import parse_settings
from pdserve.errors import GatewayUnavailable
from pdserve.gateway.app import build_app
from pdserve.gateway_address import find_gateway, forget_gateway, record_gateway
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import gateway_settings, until_ready

ADMIN_KEY, CLIENT_KEY = "sk-admin-0123456789abcdef", "sk-client-0123456789abcdef"
REPO = Path(__file__).parents[1]  # the child runs from a folder of its own: this checkout's pdserve, not the installed one


def dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_running_up_of_this_config_is_found_and_a_stopped_one_is_not(tmp_path: Path) -> None:
    settings = parse_settings({"launch": {"log_dir": str(tmp_path / "logs")}}, source="test")
    record_gateway(settings.run_dir, url="http://127.0.0.1:9000")  # as `pdserve up --port 9000` does
    found = find_gateway(settings, gateway_url=None)
    assert found.url == "http://127.0.0.1:9000" and str(settings.run_dir) in found.source
    assert find_gateway(settings, gateway_url="http://10.0.0.9:8000/").url == "http://10.0.0.9:8000"
    (settings.run_dir / "gateway.json").write_text(f'{{"url": "http://127.0.0.1:9000", "pid": {dead_pid()}}}')
    assert find_gateway(settings, gateway_url=None).url == "http://127.0.0.1:8000"
    forget_gateway(settings.run_dir)
    assert not (settings.run_dir / "gateway.json").exists()


def test_up_with_another_port_is_found_from_the_default_log_root(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    plain = parse_settings({}, source="test")  # gateway.port 8000: run folder .pdserve/logs/gateway-8000/run
    moved = parse_settings({"gateway": {"port": 9000}}, source="test")
    record_gateway(moved.run_dir, url="http://127.0.0.1:9000")
    assert find_gateway(plain, gateway_url=None).url == "http://127.0.0.1:9000"
    record_gateway(parse_settings({"gateway": {"port": 9100}}, source="test").run_dir, url="http://127.0.0.1:9100")
    with pytest.raises(GatewayUnavailable, match="--gateway-url"):
        find_gateway(plain, gateway_url=None)


async def pdserve(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """The CLI in a child process, awaited so a gateway in this event loop goes on answering."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "pdserve", *args, cwd=cwd, env={**(env or os.environ), "PYTHONPATH": str(REPO)}, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE)
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=60)
    assert process.returncode is not None
    return process.returncode, stdout.decode(), stderr.decode()


@pytest.mark.parametrize("command", [["status"], ["scale"], ["verify"]])
async def test_no_gateway_is_one_line_naming_the_url_and_the_flag(tmp_path: Path, command: list[str]) -> None:
    port = free_port()
    (tmp_path / "pd.yaml").write_text(f"gateway: {{port: {port}}}\n")
    code, _, stderr = await pdserve(*command, "--config", "pd.yaml", cwd=tmp_path)
    assert code == 1 and len(stderr.strip().splitlines()) == 1, stderr
    assert f"no gateway answers at http://127.0.0.1:{port}" in stderr and "--gateway-url" in stderr
    assert "ClientConnectorError" not in stderr and "Traceback" not in stderr


async def test_status_finds_the_gateway_up_recorded_on_another_port(tmp_path: Path) -> None:
    async with serving(FakeEngine().app(), free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url])
        async with serving(build_app(settings), settings.gateway.port) as base:
            await until_ready(base)
            # `pdserve up --port P` from tmp_path: its run folder is .pdserve/logs/gateway-P/run
            record_gateway(tmp_path / ".pdserve" / "logs" / f"gateway-{settings.gateway.port}" / "run", url=base)
            code, table, stderr = await pdserve("status", cwd=tmp_path)
    assert code == 0, stderr
    assert [line.split()[0] for line in table.splitlines()[1:]] == ["prefill", "decode"]


async def test_verify_without_the_admin_key_names_it_as_status_does(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN_KEY)
    monkeypatch.setenv(API_KEYS_ENV, CLIENT_KEY)
    child_env = {name: value for name, value in os.environ.items() if name != ADMIN_KEY_ENV}
    async with serving(FakeEngine().app(), free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url])
        async with serving(build_app(settings), settings.gateway.port) as base:
            for command in ("status", "verify"):
                code, _, stderr = await pdserve(command, "--gateway-url", base, cwd=tmp_path, env=child_env)
                assert code == 1 and f"wants the admin key: set {ADMIN_KEY_ENV}" in stderr, stderr


def test_a_record_naming_another_gateway_than_the_configs_or_loopback_gets_no_admin_key(tmp_path: Path) -> None:
    settings = parse_settings({"launch": {"log_dir": str(tmp_path / "logs")}, "gateway": {"host": "10.0.0.5"}},
                              source="test")
    for url in ("http://10.0.0.5:8000", "http://127.0.0.1:9000", "http://localhost:9000", "http://[::1]:9000"):
        record_gateway(settings.run_dir, url=url)
        assert find_gateway(settings, gateway_url=None).url == url
    for url in ("http://10.0.0.6:8000", "http://10.0.0.5:9000", "https://attacker.example", "file:///etc/passwd"):
        record_gateway(settings.run_dir, url=url)
        with pytest.raises(GatewayUnavailable, match="not sending it the admin key.*--gateway-url"):
            find_gateway(settings, gateway_url=None)
    assert find_gateway(settings, gateway_url="http://10.0.0.6:8000").url == "http://10.0.0.6:8000"  # the user's word


def test_the_gateway_record_is_readable_by_its_user_only(tmp_path: Path) -> None:
    settings = parse_settings({"launch": {"log_dir": str(tmp_path / "logs")}}, source="test")
    record_gateway(settings.run_dir, url="http://127.0.0.1:9000")
    record = settings.run_dir / "gateway.json"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    record.chmod(0o644)  # as an older pdserve wrote it
    assert find_gateway(settings, gateway_url=None).url == "http://127.0.0.1:9000"
    assert stat.S_IMODE(record.stat().st_mode) == 0o600

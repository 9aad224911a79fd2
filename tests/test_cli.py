"""The command line as a user meets it: bad configuration stops everything before any start."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tests.conftest import free_port


def pdserve(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True,
                          timeout=60, cwd=cwd, check=False)


def test_up_with_a_bad_config_exits_2_naming_fields_and_starts_nothing(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("gateway: {port: eighty}\ndecode: {engines: -1}\n")
    result = pdserve("up", "--config", "bad.yaml", cwd=tmp_path)
    assert result.returncode == 2
    assert "gateway.port" in result.stderr and "decode.engines" in result.stderr
    assert not (tmp_path / ".pdserve").exists(), "no engine log: nothing was started"


def test_config_example_validates(tmp_path: Path) -> None:
    example = pdserve("config", "example", cwd=tmp_path)
    (tmp_path / "example.yaml").write_text(example.stdout)
    result = pdserve("config", "validate", "example.yaml", cwd=tmp_path)
    assert result.returncode == 0 and "valid (prefill-0 :8100, decode-0 :8200; gateway :8000)" in result.stdout


def test_bench_compare_with_an_unknown_way_exits_2_before_any_start(tmp_path: Path) -> None:
    result = pdserve("bench", "compare", "--ways", "aggregated,sideways", cwd=tmp_path)
    assert result.returncode == 2 and "direct,aggregated,disaggregated" in result.stderr
    assert not (tmp_path / ".pdserve").exists()


def test_serve_with_log_format_json_writes_only_json_objects(tmp_path: Path) -> None:
    """Every line on stdout and stderr, from start-up to a SIGTERM, is one JSON object."""
    dead = f"http://127.0.0.1:{free_port()}"  # no engine: the health probe logs it unreachable
    command = [sys.executable, "-m", "pdserve", "serve", "--prefill-url", dead, "--decode-url", dead,
               "--port", str(free_port()), "--workers", "1", "--log-format", "json"]
    with subprocess.Popen(command, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as server:
        try:
            time.sleep(4.0)
        finally:
            server.send_signal(signal.SIGTERM)
            stdout, stderr = server.communicate(timeout=30)
    lines = [json.loads(line) for line in (stdout + stderr).splitlines()]
    assert lines[0]["message"].startswith("gateway on http://127.0.0.1:")
    assert any(line["level"] == "WARNING" and dead in line["message"] for line in lines), lines


def test_an_unknown_log_format_exits_2(tmp_path: Path) -> None:
    result = pdserve("serve", "--log-format", "xml", cwd=tmp_path)
    assert result.returncode == 2 and "xml" in result.stderr


def test_up_failing_to_start_says_why_in_one_json_object_in_json_format(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = pdserve("up", "--port", str(port), "--log-format", "json", cwd=tmp_path)
    assert result.returncode == 2
    (line,) = [json.loads(text) for text in result.stderr.splitlines()]
    assert line["level"] == "ERROR" and "ports already in use" in line["message"] and str(port) in line["message"]


def test_gateway_host_node_outside_ray_exits_2_saying_what_to_bind(tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    result = pdserve("serve", "--host", "node", "--prefill-url", dead, "--decode-url", dead, "--port", str(free_port()),
                     cwd=tmp_path)
    assert result.returncode == 2 and "gateway.host: node is for Ray" in result.stderr, result.stderr


def test_serve_on_every_interface_with_no_key_exits_2_in_one_line_saying_how_to_set_keys_or_open_it(
        tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    env_without_keys = {name: value for name, value in os.environ.items()
                        if name not in ("PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEY")}
    env_without_keys["PYTHONPATH"] = str(Path(__file__).parents[1])  # this checkout's pdserve
    result = subprocess.run([sys.executable, "-m", "pdserve", "serve", "--host", "0.0.0.0", "--prefill-url", dead,
                             "--decode-url", dead, "--port", str(free_port())], capture_output=True, text=True,
                            timeout=60, cwd=tmp_path, env=env_without_keys, check=False)
    (line,) = result.stderr.splitlines()
    assert result.returncode == 2 and "PDSERVE_API_KEYS" in line and "access.open: true" in line, result.stderr

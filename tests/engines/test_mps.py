"""CUDA MPS planning and the daemon's start/stop, with a stand-in `nvidia-cuda-mps-control` on PATH."""

from __future__ import annotations

import asyncio
import logging
import stat
from pathlib import Path

import pytest

from pdserve.config import Settings, parse_settings
from pdserve.engine_key import NO_ENGINE_KEY
from pdserve.engines.model_layout import Layout, ModelLayout
from pdserve.engines.mps import MPS_CONTROL, plan_mps, shared_gpus
from pdserve.engines.supervisor import Supervisor
from pdserve.errors import ConfigError, EngineStartFailed

# Records each call: its arguments, the pipe folder it was given, and what came on stdin. Like
# the real one, ``-d`` leaves a background process holding the inherited stdout; ``quit`` ends it.
FAKE_CONTROL = """#!/bin/sh
echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY stdin=$(cat)" >> "$CALLS"
if [ "$1" = "-d" ] && [ -z "$FAKE_EXIT" ]; then sleep 60 & echo $! > "$CALLS.daemon"; fi
if [ -z "$1" ] && [ -f "$CALLS.daemon" ]; then kill "$(cat "$CALLS.daemon")"; fi
exit ${FAKE_EXIT:-0}
"""


def gpu_settings(tmp_path: Path, *, prefill_gpu: int, decode_gpu: int, mps: str = "auto") -> Settings:
    return parse_settings({
        "prefill": {"device": "cuda", "gpu_ids": [prefill_gpu]}, "decode": {"device": "cuda", "gpu_ids": [decode_gpu]},
        "launch": {"log_dir": str(tmp_path / "logs"), "mps": mps},
    }, source="test")


@pytest.fixture
def fake_control(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    script = bin_dir / MPS_CONTROL
    script.write_text(FAKE_CONTROL)
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    calls = tmp_path / "calls.txt"
    monkeypatch.setenv("CALLS", str(calls))
    return calls


def test_only_gpus_with_two_engines_count_as_shared(tmp_path: Path) -> None:
    assert shared_gpus(gpu_settings(tmp_path, prefill_gpu=0, decode_gpu=0).engine_specs()) == {0}
    assert shared_gpus(gpu_settings(tmp_path, prefill_gpu=0, decode_gpu=1).engine_specs()) == set()
    assert shared_gpus(parse_settings({}, source="test").engine_specs()) == set()  # CPU engines


def test_engines_sharing_a_gpu_get_the_daemon_and_its_pipe(tmp_path: Path, fake_control: Path) -> None:
    layout = ModelLayout("m", Layout.ATTENTION, "test")
    supervisor = Supervisor(gpu_settings(tmp_path, prefill_gpu=0, decode_gpu=0), model_path="m", layout=layout,
                            progress=print, engine_key=NO_ENGINE_KEY)
    assert supervisor.mps is not None
    for engine in supervisor.engines:
        assert engine.command.env["CUDA_MPS_PIPE_DIRECTORY"] == str(supervisor.mps.pipe_dir)
    split = Supervisor(gpu_settings(tmp_path, prefill_gpu=0, decode_gpu=1), model_path="m", layout=layout, progress=print,
                       engine_key=NO_ENGINE_KEY)
    assert split.mps is None and all("CUDA_MPS_PIPE_DIRECTORY" not in e.command.env for e in split.engines)


async def test_daemon_starts_in_the_background_and_quits(tmp_path: Path, fake_control: Path) -> None:
    specs = gpu_settings(tmp_path, prefill_gpu=0, decode_gpu=0).engine_specs()
    daemon = plan_mps(specs, mode="auto", log_dir=tmp_path / "logs")
    assert daemon is not None
    await asyncio.wait_for(daemon.start(), timeout=5)  # returns while the forked daemon runs on
    await daemon.stop()
    started, quit_ = fake_control.read_text().splitlines()
    assert started == f"args=-d pipe={daemon.pipe_dir} stdin="
    assert quit_ == f"args= pipe={daemon.pipe_dir} stdin=quit"


async def test_a_daemon_that_will_not_start_fails_loudly(
    tmp_path: Path, fake_control: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FAKE_EXIT", "3")
    daemon = plan_mps(gpu_settings(tmp_path, prefill_gpu=0, decode_gpu=0).engine_specs(), mode="on",
                      log_dir=tmp_path)
    assert daemon is not None
    with pytest.raises(EngineStartFailed, match="exit 3.*launch.mps: off"):
        await daemon.start()


def test_without_the_binary_auto_warns_and_on_refuses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    specs = gpu_settings(tmp_path, prefill_gpu=0, decode_gpu=0).engine_specs()
    with caplog.at_level(logging.WARNING):
        assert plan_mps(specs, mode="auto", log_dir=tmp_path) is None
    assert "time-slice" in caplog.text
    with pytest.raises(ConfigError, match="launch.mps is on"):
        plan_mps(specs, mode="on", log_dir=tmp_path)
    assert plan_mps(specs, mode="off", log_dir=tmp_path) is None

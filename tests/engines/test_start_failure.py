"""A failed engine start names the exception vLLM's "See root cause above" points to, then pdserve's advice:
the pure search (engines/start_failure.py), and ``pdserve up``'s launcher running a stand-in that fails as
vLLM 0.26's server does (tests/engines/vllm_start_failure.py, its text taken from vLLM's source)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest

from pdserve.engine_config import EngineSpec, PoolSpec
from pdserve.engines.command import EngineCommand
from pdserve.engines.launcher import EngineProcess
from pdserve.engines.start_failure import advice, describe_failure, plain_line, root_cause
from pdserve.errors import EngineStartFailed
from pdserve.role import Role
from tests.conftest import free_port_block

STAND_IN = Path(__file__).with_name("vllm_start_failure.py")
MAMBA_LINE = "ValueError: max_num_seqs (1024) exceeds available Mamba cache blocks (614)."
HOST_BUFFER_LINE = "AttributeError: 'list' object has no attribute 'shape'"


def stand_in_log(case: str) -> str:
    done = subprocess.run([sys.executable, str(STAND_IN), case], capture_output=True, text=True, check=False)
    assert done.returncode == 1  # as vLLM's server exits on an uncaught RuntimeError
    return done.stdout


def test_root_cause_is_the_engine_cores_exception_not_the_api_servers_runtime_error() -> None:
    log = stand_in_log("mamba-blocks")
    assert log.rstrip().endswith("See root cause above. Failed core proc(s): {}")
    cause = root_cause(log)
    assert cause is not None
    assert cause.line.startswith(MAMBA_LINE)
    assert (cause.function, cause.lineno) == ("resolve_cudagraph_mode_and_sizes", 1491)
    assert "(in resolve_cudagraph_mode_and_sizes, vllm/config/compilation.py:1491)" in cause.summary
    assert "max_num_seqs" in advice(cause)


def test_host_buffer_failure_is_named_with_its_function_and_the_buffer_advice() -> None:
    described = describe_failure(stand_in_log("host-buffer"))
    first, fix = described.splitlines()
    assert first.startswith(HOST_BUFFER_LINE) and "initialize_host_xfer_buffer" in first
    assert "kv.buffer_device: cuda" in fix


def test_without_engine_core_marker_the_last_exception_not_see_root_cause_wins() -> None:
    log = ("Traceback (most recent call last):\n  File \"x.py\", line 3, in f\n    g()\n"
           "OSError: libcuda.so.1: cannot open shared object file\n"
           "Traceback (most recent call last):\n  File \"y.py\", line 9, in h\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    cause = root_cause(log)
    assert cause is not None and cause.line.startswith("OSError: libcuda.so.1")
    assert root_cause("INFO all fine\nno traceback here\n") is None


def test_vllm_0_32_prefixes_are_stripped() -> None:
    # vLLM 0.32's format puts the process in the record: "(EngineCore pid=N) ERROR MM-DD HH:MM:SS [file:line] "
    assert plain_line("(EngineCore pid=7) ERROR 12-06 01:52:07 [core.py:1510] EngineCore failed to start.\r") == \
        "EngineCore failed to start."


async def test_launcher_error_names_the_root_cause_line_first(tmp_path: Path) -> None:
    port = free_port_block(2)
    spec = EngineSpec(role=Role.PREFILL, index=0, port=port, side_channel_port=port + 1, gpu_ids=[], cpu_threads_bind="",
                      pool=PoolSpec())
    engine = EngineProcess(spec, EngineCommand([sys.executable, str(STAND_IN), "mamba-blocks"], {}),
                           log_path=tmp_path / "prefill-0.log")
    await engine.start()
    async with aiohttp.ClientSession() as session:
        with pytest.raises(EngineStartFailed) as failed:
            await engine.wait_ready(session, timeout_s=30, progress=lambda _line: None)
    await engine.stop()
    lines = str(failed.value).splitlines()
    assert lines[0].startswith(f"prefill-0 exited during start-up: {MAMBA_LINE}")
    assert lines[1].startswith("  fix: ") and "max_num_seqs" in lines[1]
    assert str(tmp_path / "prefill-0.log") in lines[2]

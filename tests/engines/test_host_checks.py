"""The engine's preflight: pure judgements, and the probes run against stand-in fi_info / nvidia-smi /
NIXL-python executables on PATH that print what the real tools print."""

from __future__ import annotations

import resource
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from pdserve.engine_config import KVTransferSpec, PoolSpec
from pdserve.engines import host_checks
from pdserve.engines.host_checks import (
    MEMLOCK_FIX,
    MIB,
    PREFLIGHT_PREFIX,
    check_engine_host,
    efa_provider_problem,
    memlock_check,
    memlock_problem,
    read_gpu_memory_mib,
    staging_buffer_bytes,
)
from pdserve.engines.kv_link import HostLink
from pdserve.errors import EngineStartFailed

GIB = 1024 * MIB
EFA_GPU = PoolSpec.model_validate({"device": "cuda", "gpu_ids": [0], "placement": {"efa_devices": 1}})
EFA_STAGED = KVTransferSpec(backends=["LIBFABRIC"], buffer_device="cpu")
EFA_GPUDIRECT = KVTransferSpec(backends=["LIBFABRIC"], buffer_device="cuda")
ONE_EFA = HostLink(efa_devices=("rdmap16s27",), has_peermem=False)
EFA_ENV = {"FI_PROVIDER": "efa"}
# libfabric's util/info.c prints one block per fi_info, "provider:" then indented attributes; on failure
# it prints fi_getinfo's error to stderr and main returns it (-61 -> exit status 195).
FI_INFO_OK = """#!/bin/sh
printf 'provider: efa\\n    fabric: efa\\n    domain: rdmap16s27-rdm\\n    version: 122.0\\n    type: FI_EP_RDM\\n'
printf 'provider: efa\\n    fabric: efa\\n    domain: rdmap16s27-dgrm\\n    version: 122.0\\n    type: FI_EP_DGRAM\\n'
"""
FI_INFO_NO_EFA = "#!/bin/sh\necho 'fi_getinfo: -61 (No data available)' >&2\nexit 195\n"
# nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits: MiB, one line per GPU (an L4 here).
NVIDIA_SMI_L4 = "#!/bin/sh\necho 23034\n"
# Stands in for the python that runs nixl_plugins' backend check: what that script prints when NIXL refuses.
NIXL_REFUSES = "#!/bin/sh\necho 'pdserve: backend LIBFABRIC not created: NIXL_ERR_NOT_FOUND'\n"
NIXL_CREATES = "#!/bin/sh\nexit 0\n"


@pytest.fixture
def tools(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty directory put first on PATH (and as the EFA installer's), for stand-in tools."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}:/usr/bin:/bin")
    monkeypatch.setattr(host_checks, "EFA_BIN_DIR", tmp_path / "efa-bin")
    return bin_dir


def install(directory: Path, name: str, script: str) -> str:
    directory.mkdir(exist_ok=True)
    path = directory / name
    path.write_text(script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_unlimited_memlock_pins_any_buffer() -> None:
    assert memlock_problem(None, needed_bytes=1024 * GIB, what="the KV staging buffer") is None
    assert memlock_problem(20 * GIB, needed_bytes=20 * GIB, what="the KV staging buffer") is None


def test_8_mib_against_a_20_gib_buffer_fails_naming_both_and_the_fix() -> None:
    problem = memlock_problem(8 * MIB, needed_bytes=20 * GIB, what="the KV staging buffer")
    assert problem is not None
    assert "is 8 MiB" in problem and "pin 20.0 GiB" in problem and problem.endswith(MEMLOCK_FIX)


def test_staging_buffer_is_the_pools_share_of_the_gpu() -> None:
    assert staging_buffer_bytes(EFA_GPU, gpu_memory_mib=23034) == int(23034 * MIB * 0.9)
    half = EFA_GPU.model_copy(update={"gpu_memory_utilization": 0.5})
    assert staging_buffer_bytes(half, gpu_memory_mib=23034) == 23034 * MIB // 2


async def test_a_gpudirect_buffer_needs_only_libfabrics_pools_per_efa_device() -> None:
    two_efa = HostLink(efa_devices=("rdmap16s27", "rdmap32s27"), has_peermem=True)
    problem = await memlock_check(EFA_GPU, kv=EFA_GPUDIRECT, link=two_efa, limit_bytes=8 * MIB)
    assert problem is not None and "pin 256 MiB" in problem
    assert await memlock_check(EFA_GPU, kv=EFA_GPUDIRECT, link=two_efa, limit_bytes=256 * MIB) is None


async def test_a_cpu_engines_kv_cache_is_what_it_pins() -> None:
    cpu_pool = PoolSpec(kv_cache_gib=4)
    problem = await memlock_check(cpu_pool, kv=EFA_STAGED, link=ONE_EFA, limit_bytes=4 * GIB)
    assert problem is not None and "kv_cache_gib=4" in problem and "pin 4.1 GiB" in problem


async def test_nvidia_smi_sizes_the_largest_visible_gpu(tools: Path) -> None:
    install(tools, "nvidia-smi", "#!/bin/sh\necho 23034\necho 81559\n")
    assert await read_gpu_memory_mib() == 81559
    install(tools, "nvidia-smi", "#!/bin/sh\necho \"NVIDIA-SMI has failed because it couldn't communicate\"\nexit 9\n")
    with pytest.raises(EngineStartFailed, match="exit 9: NVIDIA-SMI has failed"):
        await read_gpu_memory_mib()


async def test_a_finite_limit_is_compared_with_the_gpu_nvidia_smi_reports(tools: Path) -> None:
    install(tools, "nvidia-smi", NVIDIA_SMI_L4)
    needed_bytes = int(23034 * MIB * 0.9) + 128 * MIB
    assert await memlock_check(EFA_GPU, kv=EFA_STAGED, link=ONE_EFA, limit_bytes=needed_bytes) is None
    problem = await memlock_check(EFA_GPU, kv=EFA_STAGED, link=ONE_EFA, limit_bytes=needed_bytes - 1)
    assert problem is not None and "20.2 GiB of a 22.5 GiB GPU" in problem


async def test_fi_info_is_found_on_path_or_in_the_efa_installers_directory(tools: Path) -> None:
    problem = await efa_provider_problem(env=EFA_ENV)
    assert problem is not None and "neither on PATH nor in" in problem
    install(host_checks.EFA_BIN_DIR, "fi_info", FI_INFO_OK)
    assert await efa_provider_problem(env=EFA_ENV) is None


async def test_fi_info_that_hangs_is_killed_and_reported(tools: Path) -> None:
    install(tools, "fi_info", "#!/bin/sh\nexec sleep 30\n")
    problem = await efa_provider_problem(env=EFA_ENV, timeout_s=0.2)
    assert problem is not None and "TimeoutError" in problem


async def test_every_failed_check_is_named_on_one_prefixed_line(tools: Path) -> None:
    install(tools, "fi_info", FI_INFO_NO_EFA)
    install(tools, "nvidia-smi", NVIDIA_SMI_L4)
    python = install(tools, "nixl-python", NIXL_REFUSES)
    with pytest.raises(EngineStartFailed) as failure:
        await check_engine_host(EFA_GPU, kv=EFA_STAGED, env=EFA_ENV, link=ONE_EFA, python=python,
                                memlock_limit_bytes=8 * MIB)
    line = str(failure.value)
    assert line.startswith(f"{PREFLIGHT_PREFIX} memlock (ulimit -l) is 8 MiB") and "\n" not in line
    assert "fi_getinfo: -61 (No data available)" in line
    assert line.endswith("; NIXL LIBFABRIC: NIXL_ERR_NOT_FOUND")


async def test_a_host_with_efa_unlimited_memlock_and_the_plugin_passes(tools: Path) -> None:
    install(tools, "fi_info", FI_INFO_OK)
    python = install(tools, "nixl-python", NIXL_CREATES)
    checked = await check_engine_host(EFA_GPU, kv=EFA_STAGED, env=EFA_ENV, link=ONE_EFA, python=python,
                                      memlock_limit_bytes=None)
    assert checked == "memlock unlimited, fi_info efa, NIXL LIBFABRIC"


async def test_only_what_the_configuration_uses_is_checked(tools: Path) -> None:
    install(tools, "fi_info", FI_INFO_NO_EFA)
    python = install(tools, "nixl-python", NIXL_CREATES)
    ucx_only = await check_engine_host(EFA_GPU, kv=KVTransferSpec(), env=EFA_ENV, link=ONE_EFA, python=python,
                                       memlock_limit_bytes=8 * MIB)
    assert ucx_only == "nothing this configuration needs"
    tcp = await check_engine_host(EFA_GPU, kv=EFA_STAGED, env={"FI_PROVIDER": "tcp"}, link=ONE_EFA, python=python,
                                  memlock_limit_bytes=8 * MIB)
    assert tcp == "NIXL LIBFABRIC"


def test_the_soft_memlock_limit_is_read_as_the_engine_inherits_it() -> None:
    _soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lowered = 8 * MIB if hard == resource.RLIM_INFINITY else min(8 * MIB, hard)
    script = ("import resource; from pdserve.engines.host_checks import read_memlock_limit; "
              f"resource.setrlimit(resource.RLIMIT_MEMLOCK, ({lowered}, {hard})); print(read_memlock_limit())")
    child = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert child.stdout.strip() == str(lowered)

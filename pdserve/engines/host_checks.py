"""Checks an engine's host before vLLM starts there: the memlock limit against what NIXL will pin,
libfabric's efa provider, and NIXL's backend plugins. Reads the host (rlimit, ``fi_info``,
``nvidia-smi``) but never initialises CUDA, which would hold GPU memory for the replica's life.
"""

from __future__ import annotations

import asyncio
import os
import resource
import shutil
from collections.abc import Sequence
from pathlib import Path

from pdserve.engine_config import KVTransferSpec, PoolSpec
from pdserve.engines.kv_link import HostLink, choose_buffer_device
from pdserve.engines.nixl_plugins import backend_problems
from pdserve.errors import EngineStartFailed

# Starts the one line a failed check raises; `pdserve cloud status` finds it in Serve's deployment message.
PREFLIGHT_PREFIX = "pdserve preflight:"
EFA_BIN_DIR = Path("/opt/amazon/efa/bin")  # where the EFA installer puts fi_info
PROBE_TIMEOUT_S = 30.0
MIB = 2**20
RLIM_VALUES = 2**64  # an rlimit is a 64-bit unsigned number (rlim_t)
VLLM_GPU_MEMORY_UTILIZATION = 0.9  # vLLM's default --gpu-memory-utilization
# Each libfabric efa endpoint registers (pins) its TX and RX packet pools, 8192 packets of 8320 bytes each
# (libfabric prov/efa/src/rdm/efa_rdm_ep_fiops.c), and NIXL opens one endpoint per EFA device (rail).
# A 64 MiB floor would pass a limit that fails at the first endpoint; the common 8 MiB container default
# fails long before. AWS's EFA guides ask for memlock unlimited, as MEMLOCK_FIX does.
EFA_ENDPOINT_PINNED_BYTES = 128 * MIB
MEMLOCK_FIX = ("the GPU nodes must run containers with RLIMIT_MEMLOCK unlimited: `pdserve cloud up` sets it in "
               "the GPU node group's bootstrap (docs/deploy.md)")


def read_memlock_limit() -> int | None:
    """This process's soft RLIMIT_MEMLOCK in bytes, which the engine inherits; None when unlimited.

    The kernel keeps rlimits unsigned (the OCI spec's are uint64), but CPython returns them as a signed
    C long (Modules/resource.c rlimit2py): a limit of 2^63 or more reads negative, and RLIM_INFINITY
    reads -1 (resource.RLIM_INFINITY). Read modulo 2^64, each is the unsigned value the kernel holds."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    unsigned = soft % RLIM_VALUES
    return None if unsigned == resource.RLIM_INFINITY % RLIM_VALUES else unsigned


def format_bytes(size_bytes: float) -> str:
    """MiB below a GiB, GiB above: the unit `ulimit -l` and GPU sizes are read in."""
    return f"{size_bytes / MIB:.0f} MiB" if size_bytes < 1024 * MIB else f"{size_bytes / 1024 / MIB:.1f} GiB"


def memlock_problem(limit_bytes: int | None, *, needed_bytes: int, what: str) -> str | None:
    """Why a memlock limit (None = unlimited) cannot pin ``needed_bytes`` of ``what``, or None when it can.
    Pure. A non-root container user has no effective CAP_IPC_LOCK, so the rlimit alone decides."""
    if limit_bytes is None or limit_bytes >= needed_bytes:
        return None
    return (f"memlock (ulimit -l) is {format_bytes(limit_bytes)} but NIXL must pin {format_bytes(needed_bytes)} "
            f"({what}): {MEMLOCK_FIX}")


def efa_pinned_bytes(link: HostLink) -> int:
    """What libfabric's efa provider pins of its own: its packet pools, one endpoint per EFA device."""
    return EFA_ENDPOINT_PINNED_BYTES * max(1, len(link.efa_devices))


def staging_buffer_bytes(pool: PoolSpec, *, gpu_memory_mib: int) -> int:
    """Upper bound of a GPU engine's host KV staging buffer: vLLM sizes it as the GPU's KV cache, which
    is at most its share (gpu_memory_utilization) of one GPU's memory; each worker pins its own GPU's."""
    share = pool.gpu_memory_utilization or VLLM_GPU_MEMORY_UTILIZATION
    return int(gpu_memory_mib * MIB * share)


async def run_probe(argv: Sequence[str], *, env: dict[str, str], timeout_s: float) -> tuple[int, str]:
    """(exit code, stdout and stderr) of a short host tool; raises OSError when it cannot start and
    TimeoutError (after killing it) when it runs past ``timeout_s``."""
    process = await asyncio.create_subprocess_exec(
        *argv, env={**os.environ, **env}, stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    try:
        async with asyncio.timeout(timeout_s):
            output, _ = await process.communicate()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    assert process.returncode is not None  # communicate() returns once the tool has exited
    return process.returncode, output.decode(errors="replace")


def last_line(output: str) -> str:
    """The last non-empty line of a tool's output: the failure line must stay one line."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    return lines[-1] if lines else "(no output)"


async def efa_provider_problem(*, env: dict[str, str], timeout_s: float = PROBE_TIMEOUT_S) -> str | None:
    """Why libfabric's efa provider is not usable here (per ``fi_info -p efa``), or None when it is."""
    fi_info = shutil.which("fi_info") or shutil.which("fi_info", path=str(EFA_BIN_DIR))
    if fi_info is None:
        return f"fi_info is neither on PATH nor in {EFA_BIN_DIR}: the image lacks the EFA installer's libfabric"
    try:
        code, output = await run_probe([fi_info, "-p", "efa"], env=env, timeout_s=timeout_s)
    except (OSError, TimeoutError) as exc:
        return f"fi_info -p efa did not run: {exc!r}"
    if code != 0 or "provider: efa" not in output:
        return (f"fi_info -p efa found no efa provider (exit {code}: {last_line(output)}): the pod has no EFA "
                "interface (placement.efa_devices) or its libfabric lacks the efa provider")
    return None


async def read_gpu_memory_mib(*, timeout_s: float = PROBE_TIMEOUT_S) -> int:
    """The largest total memory of this host's visible GPUs in MiB, from nvidia-smi (no CUDA here).
    Raises EngineStartFailed when nvidia-smi is missing, fails or prints no number."""
    argv = ["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"]
    try:
        code, output = await run_probe(argv, env={}, timeout_s=timeout_s)
        sizes = [int(line) for line in output.split()] if code == 0 else []
    except (OSError, TimeoutError, ValueError) as exc:
        raise EngineStartFailed(f"nvidia-smi could not size the GPU: {exc!r}") from exc
    if not sizes:
        raise EngineStartFailed(f"nvidia-smi could not size the GPU (exit {code}: {last_line(output)})")
    return max(sizes)


async def gpu_memory_bytes(pools: Sequence[PoolSpec]) -> int | None:
    """This host's GPU memory where one of ``pools`` runs on GPUs and nvidia-smi says; None otherwise
    (engines/batch_size.py then sizes no hybrid batch from it)."""
    if not any(pool.device == "cuda" for pool in pools):
        return None
    try:
        return await read_gpu_memory_mib() * MIB
    except EngineStartFailed:
        return None


async def memlock_check(pool: PoolSpec, *, kv: KVTransferSpec, link: HostLink, limit_bytes: int | None) -> str | None:
    """Whether the memlock limit holds what an efa engine pins: its staging buffer (KV in host memory)
    or, with GPUDirect RDMA, only libfabric's own pools. GPU memory is registered through dma-buf or
    peermem and is not counted. nvidia-smi runs only where a finite limit must be compared."""
    own_bytes = efa_pinned_bytes(link)
    if limit_bytes is None or choose_buffer_device(kv, pool, link).device == "cuda":
        return memlock_problem(limit_bytes, needed_bytes=own_bytes, what="libfabric's efa packet pools")
    if pool.device == "cpu":
        buffer_bytes, what = pool.kv_cache_gib * 1024 * MIB, f"the KV cache, kv_cache_gib={pool.kv_cache_gib}"
    else:
        try:
            gpu_memory_mib = await read_gpu_memory_mib()
        except EngineStartFailed as exc:
            return f"memlock (ulimit -l) is {format_bytes(limit_bytes)} and {exc}: {MEMLOCK_FIX}"
        buffer_bytes = staging_buffer_bytes(pool, gpu_memory_mib=gpu_memory_mib)
        gpu = format_bytes(gpu_memory_mib * MIB)
        what = f"the KV staging buffer, up to {format_bytes(buffer_bytes)} of a {gpu} GPU"
    return memlock_problem(limit_bytes, needed_bytes=buffer_bytes + own_bytes,
                           what=f"{what}, and libfabric's efa packet pools")


async def check_engine_host(
    pool: PoolSpec, *, kv: KVTransferSpec, env: dict[str, str], link: HostLink, python: str,
    memlock_limit_bytes: int | None,
) -> str:
    """Check what this engine's configuration needs of the host: for KV over LIBFABRIC with the efa provider
    (``env`` is the engine's, FI_PROVIDER included) the memlock limit (None = unlimited) and fi_info; NIXL
    creating every backend but UCX (which ships in its wheel). Returns what passed, for the log; raises
    EngineStartFailed with one line: PREFLIGHT_PREFIX, then every failed check."""
    results: list[tuple[str, str | None]] = []  # (what passed, or why it failed)
    if "LIBFABRIC" in kv.backends and env.get("FI_PROVIDER") == "efa":
        memlock, fi_info = await asyncio.gather(
            memlock_check(pool, kv=kv, link=link, limit_bytes=memlock_limit_bytes), efa_provider_problem(env=env))
        limit = "unlimited" if memlock_limit_bytes is None else format_bytes(memlock_limit_bytes)
        results += [(f"memlock {limit}", memlock), ("fi_info efa", fi_info)]
    if extra := [backend for backend in kv.backends if backend != "UCX"]:
        try:
            failed = await backend_problems(extra, python=python, env=env)
        except TimeoutError:
            failed = dict.fromkeys(extra, "NIXL hung creating it")
        results += [(f"NIXL {backend}", f"NIXL {backend}: {failed[backend]}" if backend in failed else None)
                    for backend in extra]
    problems = [problem for _label, problem in results if problem is not None]
    if problems:
        raise EngineStartFailed(" ".join(f"{PREFLIGHT_PREFIX} {'; '.join(problems)}".split()))
    return ", ".join(label for label, _problem in results) or "nothing this configuration needs"

"""Print what UCX sees on this machine through the UCX that the nixl wheel bundles (an `ucx_info -d` stand-in).

The nixl wheels ship libucp/libuct and the UCX plugins (cuda_copy and cuda_ipc live in ucx/libuct_cuda.so) but no
ucx_info binary, so this loads the bundled libucp with ctypes, opens a context and a worker and prints their
resources; with UCX_LOG_LEVEL=debug the worker's interface queries also say why a capability is off. It then
prints the facts UCX's cuda_ipc decisions depend on: NVLink count and state from NVML, PID namespace, ptrace
scope (for cma). Read-only; changes nothing.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
import sys
from pathlib import Path


def bundled_libucp() -> Path:
    for package in ("nixl_cu13", "nixl_cu12", "nixl"):
        spec = importlib.util.find_spec(package)
        if spec is None or spec.origin is None:
            continue
        libs = Path(spec.origin).parent.parent / f"{package}.libs"
        found = sorted(glob.glob(str(libs / "libucp*.so*")))
        if found:
            return Path(found[0])
    raise FileNotFoundError("no libucp bundled with an installed nixl wheel")


def print_ucx_resources(libucp: Path) -> None:
    ucp = ctypes.CDLL(str(libucp), mode=ctypes.RTLD_GLOBAL)
    libc = ctypes.CDLL(None)
    libc.fdopen.restype = ctypes.c_void_p
    stdout = ctypes.c_void_p(libc.fdopen(os.dup(1), b"w"))
    major, minor, release = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_uint()
    ucp.ucp_get_version(ctypes.byref(major), ctypes.byref(minor), ctypes.byref(release))
    print(f"bundled UCX {major.value}.{minor.value}.{release.value} at {libucp}", flush=True)
    config = ctypes.c_void_p()
    assert ucp.ucp_config_read(None, None, ctypes.byref(config)) == 0
    params = (ctypes.c_uint64 * 64)()  # ucp_params_t, zeroed; only field_mask and features set
    params[0], params[1] = 1, 0b11  # UCP_PARAM_FIELD_FEATURES; UCP_FEATURE_TAG | UCP_FEATURE_RMA
    context = ctypes.c_void_p()
    status = ucp.ucp_init_version(major, minor, params, config, ctypes.byref(context))
    if status != 0:
        print(f"ucp_init failed: status {status}")
        return
    ucp.ucp_context_print_info(context, stdout)
    worker_params = (ctypes.c_uint64 * 64)()
    worker = ctypes.c_void_p()
    if ucp.ucp_worker_create(context, worker_params, ctypes.byref(worker)) == 0:
        ucp.ucp_worker_print_info(worker, stdout)
    libc.fflush(stdout)


def print_nvlink_state() -> None:
    try:
        import pynvml
    except ImportError:
        print("pynvml not importable: NVLink state unknown")
        return
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        print(f"NVML unavailable ({exc}): UCX then counts 0 NVLinks")
        return
    device = pynvml.nvmlDeviceGetHandleByIndex(0)
    print(f"GPU0 {pynvml.nvmlDeviceGetName(device)}; NVML devices: {pynvml.nvmlDeviceGetCount()}")
    (value,) = pynvml.nvmlDeviceGetFieldValues(device, [pynvml.NVML_FI_DEV_NVLINK_LINK_COUNT])
    links = value.value.uiVal if value.nvmlReturn == 0 else 0
    print(f"NVML_FI_DEV_NVLINK_LINK_COUNT: return {value.nvmlReturn}, links {links}")
    for link in range(links):
        try:
            state = pynvml.nvmlDeviceGetNvLinkState(device, link)
            remote = pynvml.nvmlDeviceGetNvLinkRemotePciInfo(device, link).busId
            print(f"  link {link}: state {state}, remote {remote}")
        except pynvml.NVMLError as exc:
            print(f"  link {link}: {exc}  <- UCX then counts 0 NVLinks and turns cuda_ipc get_zcopy off")
            break


def print_process_facts() -> None:
    scope = Path("/proc/sys/kernel/yama/ptrace_scope")
    print(
        f"pid namespace {os.readlink('/proc/self/ns/pid')}; ptrace_scope "
        f"{scope.read_text().strip() if scope.exists() else 'absent'}; UCX_* env: "
        f"{ {k: v for k, v in os.environ.items() if k.startswith('UCX_')} }"
    )


def main() -> int:
    try:
        import torch

        torch.zeros(1, device="cuda")  # a CUDA context first, as in a vLLM worker
    except (ImportError, RuntimeError, AssertionError) as exc:  # torch raises AssertionError when built without CUDA
        print(f"no CUDA context: {exc}")
    print_process_facts()
    print_nvlink_state()
    print_ucx_resources(bundled_libucp())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``python -m pdserve_vllm.engine_server ARGS``: vLLM's OpenAI server, unchanged, except that on CPU
its engine core starts the way VLLM_WORKER_MULTIPROC_METHOD says, where vLLM-CPU always spawns it.

pdserve sets fork for CPU engines (engines/command.py): the engine core is then a fork of the server
process and skips importing torch and vLLM a second time, which brought the 2-core demo's
`pdserve up` from 31-37 s to 21-28 s (docs/benchmarks.md, section 9). Fork only with the "uni"
executor, the one process started then, before the server has run any model or OpenMP code.
A forked engine core closes its copy of the server's listening socket: else a killed server's port
would stay bound, accepting connections nobody answers, until the engine core noticed and exited.
"""

from __future__ import annotations

import os
import runpy
import socket

from vllm.platforms.cpu import CpuPlatform

from pdserve_vllm import VLLM_SERVER_MODULE

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"


def keep_start_method(method: str) -> None:
    """After vLLM-CPU's config check has set its start method, put ``method`` back."""
    check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_then_keep(cls: type[CpuPlatform], vllm_config: object) -> None:
        check(cls, vllm_config)
        os.environ[START_METHOD_ENV] = method

    CpuPlatform.check_and_update_config = classmethod(check_then_keep)  # type: ignore[method-assign,assignment]


def close_listening_sockets() -> None:
    """In a forked engine core: close the copy of the server's listening TCP socket (vLLM binds it
    before it starts the engine), so only the server holds the port; a spawned one never had it."""
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except OSError:  # not a socket
            continue
        is_tcp = sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
        try:
            is_listening = is_tcp and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)
        except OSError:
            is_listening = False
        if is_listening:
            sock.close()
        else:
            sock.detach()  # not ours to close


if __name__ == "__main__":
    os.register_at_fork(after_in_child=close_listening_sockets)
    keep_start_method(os.environ.get(START_METHOD_ENV, "spawn"))
    runpy.run_module(VLLM_SERVER_MODULE, run_name="__main__", alter_sys=True)

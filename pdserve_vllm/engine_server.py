"""``python -m pdserve_vllm.engine_server ARGS``: vLLM's OpenAI server, unchanged, except that on CPU
its engine core starts the way VLLM_WORKER_MULTIPROC_METHOD says, where vLLM-CPU always spawns it.

pdserve sets fork for CPU engines (engines/command.py): the engine core is then a fork of the server
process and skips importing torch and vLLM a second time, which brought the 2-core demo's
`pdserve up` from 30-35 s to 21-29 s (docs/benchmarks.md, section 9). Fork only with the "uni"
executor, the one process started then, before the server has run any model or OpenMP code.
A forked engine core closes its copy of the server's socket: else it would keep the port bound and
listening, and a killed server's port would accept connections nobody answers until the engine core
noticed and exited.
"""

from __future__ import annotations

import os
import runpy
import socket
import sys

from pdserve_vllm.contract import Hook
from pdserve_vllm.contract_check import require

require(Hook.ENGINE_SERVER)  # before vLLM's imports: a release without these names is refused by name (contract.py)

from vllm.platforms.cpu import CpuPlatform

from pdserve_vllm import VLLM_SERVER_MODULE

START_METHOD_ENV = "VLLM_WORKER_MULTIPROC_METHOD"
VLLM_DEFAULT_PORT = 8000


def keep_start_method(method: str) -> None:
    """After vLLM-CPU's config check has set its start method, put ``method`` back."""
    check = CpuPlatform.check_and_update_config.__func__  # type: ignore[attr-defined]

    def check_then_keep(cls: type[CpuPlatform], vllm_config: object) -> None:
        check(cls, vllm_config)
        os.environ[START_METHOD_ENV] = method

    CpuPlatform.check_and_update_config = classmethod(check_then_keep)  # type: ignore[method-assign,assignment]


def close_server_socket(port: int) -> None:
    """In a forked engine core: close the copy of the server's TCP socket on ``port``. vLLM binds it
    before it starts the engine and listens on it only afterwards, so at the fork it is bound, not yet
    listening, and a copy left open would accept connections on the port once the server listens."""
    for name in os.listdir("/proc/self/fd"):
        try:
            sock = socket.socket(fileno=int(name))
        except OSError:  # not a socket (or the directory listing's own descriptor, gone by now)
            continue
        try:
            is_server = (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                         and sock.getsockname()[1] == port)
        except OSError:
            is_server = False
        if is_server:
            sock.close()
        else:
            sock.detach()  # not ours to close


def server_port(argv: list[str]) -> int:
    """The ``--port`` vLLM's server is given (``--port N`` or ``--port=N``), else vLLM's default."""
    for index, arg in enumerate(argv):
        if arg == "--port" and index + 1 < len(argv):
            return int(argv[index + 1])
        if arg.startswith("--port="):
            return int(arg.removeprefix("--port="))
    return VLLM_DEFAULT_PORT


if __name__ == "__main__":
    port = server_port(sys.argv[1:])
    os.register_at_fork(after_in_child=lambda: close_server_socket(port))
    keep_start_method(os.environ.get(START_METHOD_ENV, "spawn"))
    runpy.run_module(VLLM_SERVER_MODULE, run_name="__main__", alter_sys=True)

"""The CPU engines' server wrapper: a forked engine core keeps no copy of the server's port."""

from __future__ import annotations

import os
import socket

import pytest

from pdserve_vllm.engine_server import VLLM_DEFAULT_PORT, close_server_socket, server_port


def test_a_forked_child_closes_the_servers_socket_bound_before_listening_and_keeps_the_others() -> None:
    with socket.socket() as server, socket.socket() as other:
        server.bind(("127.0.0.1", 0))  # as vLLM does: bound before the engine core starts, listening after
        other.bind(("127.0.0.1", 0))
        pid = os.fork()
        if pid == 0:  # the child reports by exit status: 0 only if the server's socket alone went
            close_server_socket(server.getsockname()[1])
            try:
                os.fstat(server.fileno())
                os._exit(1)
            except OSError:
                os._exit(0 if os.fstat(other.fileno()) else 2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        server.listen()  # the parent's copy is untouched


@pytest.mark.parametrize(("argv", "port"), [
    (["--model", "m", "--port", "8200"], 8200), (["--port=8100", "--host", "h"], 8100), (["--model", "m"], VLLM_DEFAULT_PORT),
])
def test_the_servers_port_is_read_from_its_arguments(argv: list[str], port: int) -> None:
    assert server_port(argv) == port

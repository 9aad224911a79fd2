"""The CPU engines' server wrapper: a forked engine core keeps no copy of the server's port."""

from __future__ import annotations

import os
import socket

from pdserve_vllm.engine_server import close_listening_sockets


def test_a_forked_child_closes_the_listening_socket_and_keeps_the_others() -> None:
    with socket.socket() as listener, socket.socket() as other:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        pid = os.fork()
        if pid == 0:  # the child reports by exit status: 0 only if the listener alone went
            close_listening_sockets()
            try:
                os.fstat(listener.fileno())
                os._exit(1)
            except OSError:
                os._exit(0 if os.fstat(other.fileno()) else 2)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        listener.getsockname()  # the parent's copy is untouched

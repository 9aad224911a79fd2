"""Logging through a queue: the caller never waits for the write, and nothing is lost at exit."""

from __future__ import annotations

import io
import logging
import threading

from pdserve.logs import logging_off_the_loop


class BlockedStream(io.StringIO):
    """A stderr that cannot take a write until ``unblock`` is set, like a full pipe."""

    def __init__(self) -> None:
        super().__init__()
        self.unblock = threading.Event()

    def write(self, text: str) -> int:
        self.unblock.wait()
        return super().write(text)


def test_a_blocked_stderr_does_not_block_the_logger_and_every_line_is_written_at_exit() -> None:
    stream = BlockedStream()
    with logging_off_the_loop(logging.INFO, handler=logging.StreamHandler(stream)):
        caller = threading.Thread(target=lambda: [logging.getLogger("pdserve.test").info("leg %d", n) for n in range(3)],
                                  daemon=True)
        caller.start()
        caller.join(timeout=5)
        was_blocked = caller.is_alive()
        logging.getLogger("pdserve.test").debug("below the level")
        stream.unblock.set()
    assert not was_blocked, "logging waited for the blocked stream"
    lines = stream.getvalue().splitlines()
    assert [line.split(": ", 1)[1] for line in lines] == ["leg 0", "leg 1", "leg 2"]
    assert "INFO pdserve.test" in lines[0]

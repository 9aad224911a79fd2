"""Logging for the long-running commands: records are written to stderr by a thread.

The gateway logs a line per leg from its event loop. Written inline, a stderr that blocks (a full
pipe, a stopped terminal) would stall every stream it serves; here the loop only formats and
queues the record. (Latency did not move measurably either way: docs/benchmarks.md.)
"""

from __future__ import annotations

import logging
import queue
from collections.abc import Iterator
from contextlib import contextmanager
from logging.handlers import QueueHandler, QueueListener

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


@contextmanager
def logging_off_the_loop(level: int, *, handler: logging.Handler | None = None) -> Iterator[None]:
    """Route the root logger through a queue to ``handler`` (stderr) for the block; every record
    is written before the block exits."""
    target = handler or logging.StreamHandler()
    target.setFormatter(logging.Formatter(LOG_FORMAT))
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = QueueListener(records, target)
    enqueue = QueueHandler(records)
    enqueue.setFormatter(logging.Formatter("%(message)s"))  # the message with its args; the rest at the writer
    logging.basicConfig(level=level, handlers=[enqueue], force=True)
    listener.start()
    try:
        yield
    finally:
        listener.stop()

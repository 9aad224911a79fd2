"""Logging for the long-running commands: records are written to stderr by a thread, as text or
as one JSON object per line (``launch.log_format``).

The gateway logs a line per leg from its event loop. Written inline, a stderr that blocks (a full
pipe, a stopped terminal) would stall every stream it serves; here the loop only formats and
queues the record, and the JSON encoding happens on the writer's thread. (Latency did not move
measurably either way: docs/benchmarks.md.) Every record is one line: what an engine or a client wrote into
it (error text, a model name) cannot start a line of its own (``escape_controls``).
"""

from __future__ import annotations

import json
import logging
import queue
import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from logging.handlers import QueueHandler, QueueListener
from typing import Any

from pdserve.engine_config import LogFormat

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# ``request_id=abc role=decode elapsed_ms=12.5``: the structured part of a line, as the gateway writes it.
_FIELD = re.compile(r"(?<!\S)([a-z][a-z0-9_]*)=(\S+)")
_NUMBER = re.compile(r"-?\d+(\.\d+)?")
# Names, not numbers, even when they look like one (a client's X-Request-Id of "42").
TEXT_FIELDS = frozenset({"request_id", "role", "mode", "endpoint", "prefill_endpoint"})
RECORD_KEYS = ("time", "level", "logger", "message")
# What could forge a log line or hide text from its reader: C0 and C1 controls (CR, LF, ESC, ...), Unicode's
# line and paragraph separators, and its bidirectional overrides and isolates.
_UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069]")
TRACEBACK_PREFIX = "  | "  # each line of a record's traceback: none can pass for a record of its own


class JsonFormatter(logging.Formatter):
    """One JSON object per record: time (UTC, ISO 8601), level, logger, message, and every
    ``key=value`` pair of the message's first line as a field (numbers as numbers)."""

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info and not record.exc_text:
            record.exc_text = self.formatException(record.exc_info)
        if record.exc_text:
            message = f"{message}\n{record.exc_text}"
        line: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname, "logger": record.name, "message": message,
        }
        return json.dumps(line | message_fields(message), ensure_ascii=False)


def message_fields(message: str) -> dict[str, Any]:
    """The ``key=value`` pairs of ``message``'s first line; a key that names a record field is left
    in the message only. Pure."""
    fields: dict[str, Any] = {}
    for key, value in _FIELD.findall(message.partition("\n")[0]):
        if key in RECORD_KEYS:
            continue
        is_number = key not in TEXT_FIELDS and _NUMBER.fullmatch(value)
        fields[key] = (float(value) if "." in value else int(value)) if is_number else value
    return fields


def escape_controls(text: str) -> str:
    """``text`` with each character that could forge a log line or hide text written as its Python escape
    (``\\r``, ``\\n``, ``\\x1b``, ``\\u2028``). Pure."""
    return _UNSAFE.sub(lambda match: match.group().encode("unicode_escape").decode("ascii"), text)


class OneLineFormatter(logging.Formatter):
    """A record's message, its arguments filled in, on one line with its control characters escaped; its
    traceback, if any, on the lines below, each escaped and starting with TRACEBACK_PREFIX."""

    def formatMessage(self, record: logging.LogRecord) -> str:
        return escape_controls(super().formatMessage(record))

    def formatException(self, ei: Any) -> str:
        return _prefixed(super().formatException(ei))

    def formatStack(self, stack_info: str) -> str:
        return _prefixed(super().formatStack(stack_info))


def _prefixed(text: str) -> str:
    return "\n".join(TRACEBACK_PREFIX + escape_controls(line) for line in text.split("\n"))


def make_formatter(log_format: LogFormat) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else logging.Formatter(LOG_FORMAT)


def progress_printer(log_format: LogFormat) -> Callable[[str], None]:
    """What prints a progress line for the user on stdout: the line itself, or in JSON a record
    of logger ``pdserve`` at INFO, so every line a log pipeline reads is one object."""
    if log_format == "text":
        return lambda line: print(line, flush=True)
    return lambda line: print(_json_record(line, level=logging.INFO), flush=True)


def error_line(message: str, log_format: LogFormat) -> str:
    """The line a command prints on stderr as it exits on an error: ``error: ...``, or a JSON record
    of logger ``pdserve`` at ERROR."""
    return f"error: {message}" if log_format == "text" else _json_record(message, level=logging.ERROR)


def _json_record(message: str, *, level: int) -> str:
    record = logging.makeLogRecord({"name": "pdserve", "levelno": level, "levelname": logging.getLevelName(level),
                                    "msg": message})
    return JsonFormatter().format(record)


@contextmanager
def logging_off_the_loop(level: int, *, handler: logging.Handler | None = None,
                         log_format: LogFormat = "text") -> Iterator[None]:
    """Route the root logger through a queue to ``handler`` (stderr) for the block, written as
    ``log_format``; every record is written before the block exits."""
    target = handler or logging.StreamHandler()
    target.setFormatter(make_formatter(log_format))
    records: queue.SimpleQueue[logging.LogRecord] = queue.SimpleQueue()
    listener = QueueListener(records, target)
    enqueue = QueueHandler(records)
    enqueue.setFormatter(OneLineFormatter("%(message)s"))  # the message with its args; the rest at the writer
    logging.basicConfig(level=level, handlers=[enqueue], force=True)
    listener.start()
    try:
        yield
    finally:
        listener.stop()

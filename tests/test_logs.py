"""Logging through a queue: the caller never waits for the write, and nothing is lost at exit; as text or
one JSON object per line."""

from __future__ import annotations

import io
import json
import logging
import threading
from datetime import datetime
from typing import Any

import aiohttp
import pytest

from pdserve.engine_config import LogFormat
from pdserve.logs import logging_off_the_loop, message_fields, progress_printer
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, ready_gateway_over


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


def json_lines(text: str) -> list[dict[str, Any]]:
    """Every line parsed: each must be one JSON object."""
    return [json.loads(line) for line in text.splitlines()]


def test_json_lines_turn_the_gateways_key_value_pairs_into_fields() -> None:
    stream = io.StringIO()
    with logging_off_the_loop(logging.INFO, handler=logging.StreamHandler(stream), log_format="json"):
        logging.getLogger("pdserve.gateway.orchestrator").info(
            "request_id=%s mode=pd endpoint=%s status=200 elapsed_ms=%.1f", "42", "http://127.0.0.1:8200", 12.5)
        logging.getLogger("pdserve.up").warning("plain line, no fields")
    first, second = json_lines(stream.getvalue())
    assert first["level"] == "INFO" and first["logger"] == "pdserve.gateway.orchestrator"
    assert {key: first[key] for key in ("request_id", "mode", "endpoint", "status", "elapsed_ms")} == {
        "request_id": "42", "mode": "pd", "endpoint": "http://127.0.0.1:8200", "status": 200, "elapsed_ms": 12.5}
    assert first["message"].startswith("request_id=42 mode=pd")
    assert datetime.fromisoformat(first["time"]).tzinfo is not None
    assert set(second) == {"time", "level", "logger", "message"} and second["level"] == "WARNING"


def test_a_json_line_keeps_a_traceback_and_a_multi_line_message_in_one_object() -> None:
    stream = io.StringIO()
    with logging_off_the_loop(logging.INFO, handler=logging.StreamHandler(stream), log_format="json"):
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("pdserve.test").exception("request_id=r1 unexpected error")
        logging.getLogger("pdserve.test").error("prefill-0 DIED. Log tail:\nline one\nstatus=7")
    crash, died = json_lines(stream.getvalue())
    assert crash["request_id"] == "r1" and "ValueError: boom" in crash["message"]
    assert died["message"].endswith("line one\\nstatus=7") and "status" not in died, "escaped, on the first line"


def test_message_fields_keep_names_as_text_and_never_shadow_the_record() -> None:
    assert message_fields("request_id=7 role=prefill prompt_tokens=12 kv_blocks=3 level=x message=y") == {
        "request_id": "7", "role": "prefill", "prompt_tokens": 12, "kv_blocks": 3}
    assert message_fields("a url=http://h:1/x?q=1 and text") == {"url": "http://h:1/x?q=1"}


def test_progress_lines_are_json_objects_too_in_json_format(capsys: pytest.CaptureFixture[str]) -> None:
    progress_printer("json")("ready in 9s: OpenAI API at http://127.0.0.1:8000/v1")
    progress_printer("text")("plain")
    json_line, text_line = capsys.readouterr().out.splitlines()
    assert json.loads(json_line)["message"] == "ready in 9s: OpenAI API at http://127.0.0.1:8000/v1"
    assert text_line == "plain"


async def test_a_gateway_logging_json_writes_one_object_per_request_with_both_legs_timing() -> None:
    stream = io.StringIO()
    with logging_off_the_loop(logging.INFO, handler=logging.StreamHandler(stream), log_format="json"):
        async with ready_gateway_over(FakeEngine()) as base, aiohttp.ClientSession() as session:
            body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
            headers = {"X-Request-Id": "json-log-test"}
            async with session.post(base + "/v1/completions", json=body, headers=headers) as reply:
                await reply.read()
    [line] = [line for line in json_lines(stream.getvalue()) if line.get("request_id") == "json-log-test"]
    assert line["mode"] == "pd" and line["status"] == 200 and line["kv_blocks"] >= 1
    assert line["endpoint"].startswith("http://127.0.0.1:") and line["prefill_endpoint"].startswith("http://127.0.0.1:")
    assert 0 < line["prefill_ms"] <= line["ttft_ms"] <= line["elapsed_ms"], line


FORGED = "oops\r\n2030-01-01 00:00:00,000 INFO pdserve.gateway.app: admin logged in\x1b[2J\u2028\x85\u202eend"


@pytest.mark.parametrize("log_format", ["text", "json"])
def test_what_an_engine_or_client_wrote_is_escaped_and_cannot_make_a_record_of_its_own(log_format: LogFormat) -> None:
    """Log injection: an engine's error text (or a client's model name) with CR/LF and other control
    characters, in a message and in an exception's text, never starts a line that reads as a record."""
    stream = io.StringIO()
    with logging_off_the_loop(logging.INFO, handler=logging.StreamHandler(stream), log_format=log_format):
        log = logging.getLogger("pdserve.test")
        log.warning("request_id=r1 decode leg failed: %s", FORGED)
        try:
            raise ValueError(FORGED)
        except ValueError:
            log.exception("request_id=r2 unexpected error")
    lines = stream.getvalue().splitlines()  # splits at \r, \x1c-\x1e, \x85 and \u2028 too
    if log_format == "json":
        objects = json_lines(stream.getvalue())
        assert [record["request_id"] for record in objects] == ["r1", "r2"]
        lines = [line for record in objects for line in record["message"].splitlines()]
    records = [line for line in lines if not line.startswith("  | ")]  # a traceback's lines start so
    assert len(records) == 2 and "oops\\r\\n2030-01-01 00:00:00,000 INFO" in records[0]
    assert "\\x1b[2J\\u2028\\x85\\u202eend" in records[0]
    assert not [line for line in lines if "\x1b" in line or "\u202e" in line or "\r" in line]
    assert [line for line in lines if "ValueError: oops\\r" in line], "the exception's text is there, escaped"

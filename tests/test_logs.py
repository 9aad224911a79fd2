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
    assert died["message"].endswith("line one\nstatus=7") and "status" not in died, "fields come from the first line"


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

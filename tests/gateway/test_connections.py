"""No client can starve the rest before a key is checked: the gateway's limits on client connections
(gateway/connections.py), tried over real sockets against the real gateway app under make_server: in this
process, or as `pdserve serve` in a child process where its open-file limit or its CPU time matters."""

from __future__ import annotations

import asyncio
import json
import os
import resource
import socket
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psutil
import pytest

from pdserve.access import API_KEYS_ENV
from pdserve.access_config import AccessSpec
from pdserve.config import Settings
from pdserve.errors import ConfigError
from pdserve.gateway.app import build_app
from pdserve.gateway.connections import RESERVED_FILES, connection_limits, limits_of
from pdserve.gateway.server import GatewayWorkers, make_gateway_server, make_server
from pdserve.gateway_config import GatewaySpec
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import gateway_settings, until_ready

KEY_A, KEY_B = "a-key-for-tenant-a-0123456789", "a-key-for-tenant-b-0123456789"
OPEN_FILES = 512
IDLE_SOCKETS = 600
LONG_LINE_BYTES = 96 * 2**20
DEADLINE_S = 20.0  # for what must happen: a condition awaited, never a time assumed
# Quiet background work in a gateway whose CPU time is measured: probes and scrapes far apart.
QUIET = {"PDSERVE_GATEWAY__HEALTH_INTERVAL_S": "600", "PDSERVE_GATEWAY__KV_SCRAPE_INTERVAL_S": "600",
         "PDSERVE_ROUTING__LOAD_SCRAPE_INTERVAL_S": "600", "PDSERVE_ROUTING__LOAD_MAX_AGE_S": "1200"}


@pytest.fixture
async def engine_url() -> AsyncIterator[str]:
    async with serving(FakeEngine().app(), free_port()) as url:
        yield url


def test_connections_are_capped_at_half_the_open_files_left_after_the_reserve() -> None:
    """Each connection with a request in flight holds an engine connection too."""
    spec = GatewaySpec(max_connections=8192)
    assert limits_of(spec, AccessSpec(), open_files=OPEN_FILES).max_connections == (OPEN_FILES - RESERVED_FILES) // 2
    assert limits_of(spec, AccessSpec(), open_files=1_048_576).max_connections == 8192
    with pytest.raises(ConfigError, match="open-file limit"):
        limits_of(spec, AccessSpec(), open_files=RESERVED_FILES + 1)


async def test_600_idle_sockets_leave_health_live_answering_with_512_open_files(engine_url: str,
                                                                               tmp_path: Path) -> None:
    env = {"PDSERVE_GATEWAY__HEADER_TIMEOUT_S": "600"}  # idle sockets are closed for the cap, not their deadline
    async with _gateway_process(engine_url, tmp_path, env=env, open_files=OPEN_FILES) as (port, _):
        idle = [await asyncio.open_connection("127.0.0.1", port) for _ in range(IDLE_SOCKETS)]
        try:
            await _until_accepted(port)  # the gateway took in every one
            status, _, body = await asyncio.wait_for(_get(port, "/health/live"), timeout=1.0)
            assert (status, body) == (200, b'{"status": "alive"}')
            assert await asyncio.wait_for(idle[0][0].read(), DEADLINE_S) == b"", "the longest idle was closed"
        finally:
            for _, writer in idle:
                writer.close()


async def test_a_96_mib_request_line_is_cut_off_within_100_ms_of_the_gateway_s_cpu(engine_url: str,
                                                                                   tmp_path: Path) -> None:
    """CPU time of the gateway process, not the client's wall time: on a loaded machine it still measures
    the gateway's own work (every thread; the event loop's is part of it)."""
    async with _gateway_process(engine_url, tmp_path, env=QUIET) as (port, gateway):
        assert (await _get(port, "/health/live"))[0] == 200  # first-request costs paid before measuring
        before_s = _cpu_s(gateway)
        sent = await asyncio.to_thread(_send_long_request_line, port)
        spent_s = _cpu_s(gateway) - before_s
    assert sent < LONG_LINE_BYTES, "the gateway closed the connection before the line ended"
    assert spent_s < 0.1


@pytest.mark.parametrize("head", [b"GET /" + b"a" * 20_000,
                                  b"GET / HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 20_000],
                         ids=["request-line", "header"])
async def test_a_request_head_past_max_header_bytes_gets_431_before_it_ends(engine_url: str, head: bytes) -> None:
    async with _gateway(gateway_settings(prefill=[engine_url], decode=[engine_url])) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(head)  # never ended: no CRLF CRLF
        status, headers, body = await asyncio.wait_for(_reply(reader), DEADLINE_S)
        assert status == 431 and headers["connection"] == "close"
        assert json.loads(body)["error"] == {"message": "the request line and headers exceed 16384 bytes",
                                             "type": "invalid_request_error", "param": None,
                                             "code": "request_header_fields_too_large"}
        assert await asyncio.wait_for(reader.read(), DEADLINE_S) == b""
        writer.close()


async def test_a_half_sent_request_and_a_silent_connection_are_closed_after_header_timeout_s(engine_url: str) -> None:
    settings = gateway_settings(prefill=[engine_url], decode=[engine_url], header_timeout_s=0.5)
    async with _gateway(settings) as port:
        opened_s = time.monotonic()  # before the connections: the gateway's timers start once each is accepted
        half_sent = await asyncio.open_connection("127.0.0.1", port)
        silent = await asyncio.open_connection("127.0.0.1", port)
        half_sent[1].write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n")
        for reader, writer in (half_sent, silent):
            assert await asyncio.wait_for(reader.read(), DEADLINE_S) == b""
            writer.close()
        assert time.monotonic() - opened_s >= 0.5


async def test_on_a_keep_alive_connection_each_request_head_has_its_own_deadline(engine_url: str) -> None:
    """Requests spread over more than header_timeout_s, two of them pipelined in one write, are all served;
    a half-sent one after them is closed."""
    settings = gateway_settings(prefill=[engine_url], decode=[engine_url], header_timeout_s=1.0)
    async with _gateway(settings) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for count in (2, 1, 1):
            writer.write(_request("/health/live", {}) * count)
            for _ in range(count):
                assert (await asyncio.wait_for(_reply(reader), DEADLINE_S))[0] == 200
            await asyncio.sleep(0.6)
        writer.write(b"GET /health/live HTTP/1.1\r\nHost: x\r\n")
        assert await asyncio.wait_for(reader.read(), DEADLINE_S) == b""
        writer.close()


async def test_an_idle_keep_alive_connection_is_closed_after_idle_timeout_s(engine_url: str) -> None:
    """After a streamed completion, written by the relay straight to the transport."""
    settings = gateway_settings(prefill=[engine_url], decode=[engine_url], idle_timeout_s=0.5)
    async with _gateway(settings) as port:
        await until_ready(f"http://127.0.0.1:{port}")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(_completion(settings))
        await asyncio.wait_for(_until_in(reader, b"data: [DONE]\n\n\r\n0\r\n\r\n"), DEADLINE_S)
        answered_s = time.monotonic()
        assert await asyncio.wait_for(reader.read(), DEADLINE_S) == b""
        assert time.monotonic() - answered_s >= 0.5
        writer.close()


async def test_past_max_connections_with_none_idle_a_new_connection_is_closed_and_the_streams_go_on() -> None:
    fake = FakeEngine()
    async with serving(fake.app(), free_port()) as url:
        settings = gateway_settings(prefill=[url], decode=[url], max_connections=16)
        async with _gateway(settings) as port:
            await until_ready(f"http://127.0.0.1:{port}")
            fake.decode_gate = gate = asyncio.Event()  # every decode leg now waits, its stream open, until set
            decode_legs = _decode_legs(fake) + 16
            streams = [await asyncio.open_connection("127.0.0.1", port) for _ in range(16)]
            try:
                for _, writer in streams:
                    writer.write(_completion(settings))
                deadline_s = time.monotonic() + DEADLINE_S
                while _decode_legs(fake) < decode_legs:  # a condition, not a time
                    assert time.monotonic() < deadline_s, "the streams did not reach the engine"
                    await asyncio.sleep(0.02)
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                assert await asyncio.wait_for(reader.read(), DEADLINE_S) == b""
            finally:
                gate.set()  # else the server's shutdown waits on the streams
            for reader, writer in streams:
                await asyncio.wait_for(_until_in(reader, b"data: [DONE]"), DEADLINE_S)
                writer.close()


async def test_a_key_past_its_connections_gets_429_with_retry_after_and_is_closed(
        engine_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, f"{KEY_A},{KEY_B}")
    settings = gateway_settings(prefill=[engine_url], decode=[engine_url]).model_copy(
        update={"access": AccessSpec(per_key_max_connections=2)})
    async with _gateway(settings) as port:
        held = [await _connection_with(port, KEY_A) for _ in range(2)]
        assert [status for status, _ in held] == [200, 200]
        status, (_, writer) = await _connection_with(port, KEY_A, expect_close=True)
        assert status == 429
        assert (await _connection_with(port, KEY_B))[0] == 200, "another key is not held back"
        held[0][1][1].close()
        await _until_status(port, KEY_A, 200)  # a connection closed frees its place
        writer.close()


async def test_each_gateway_worker_holds_its_connections_to_the_header_deadline(engine_url: str) -> None:
    settings = gateway_settings(prefill=[engine_url], decode=[engine_url], header_timeout_s=0.5, workers=2)
    workers = make_gateway_server(settings)
    assert isinstance(workers, GatewayWorkers)
    task = asyncio.create_task(workers.serve())
    try:
        while not workers.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.05)
        silent = [await asyncio.open_connection("127.0.0.1", settings.gateway.port) for _ in range(8)]
        for reader, writer in silent:  # SO_REUSEPORT spread them over both workers
            assert await asyncio.wait_for(reader.read(), DEADLINE_S) == b""
            writer.close()
    finally:
        workers.should_exit = True
        await task


@asynccontextmanager
async def _gateway(settings: Settings) -> AsyncIterator[int]:
    """The gateway app in this process, held to its connection limits as `pdserve serve` holds it."""
    port = settings.gateway.port
    server = make_server(build_app(settings), host="127.0.0.1", port=port, limits=connection_limits(settings))
    task = asyncio.create_task(server.serve())
    try:
        while not server.started:
            assert not task.done(), task.exception()
            await asyncio.sleep(0.01)
        yield port
    finally:
        server.should_exit = True
        await task


@asynccontextmanager
async def _gateway_process(engine_url: str, tmp_path: Path, *, env: dict[str, str],
                           open_files: int | None = None) -> AsyncIterator[tuple[int, psutil.Process]]:
    """`pdserve serve` (one process, on uvloop) in a child, started with ``open_files`` as its RLIMIT_NOFILE."""
    port = free_port()

    def limit_open_files() -> None:
        if open_files is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (open_files, open_files))

    log_path = tmp_path / "gateway.log"
    with log_path.open("wb") as log:
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "pdserve", "serve", "--prefill-url", engine_url, "--decode-url", engine_url,
            "--port", str(port), "--workers", "1", env={**os.environ, **env}, stdout=log, stderr=log,
            preexec_fn=limit_open_files)
    try:
        await _until_live(port, process, log_path)
        yield port, psutil.Process(process.pid)
    finally:
        process.terminate()
        await process.wait()


async def _until_live(port: int, process: asyncio.subprocess.Process, log_path: Path) -> None:
    deadline_s = time.monotonic() + 120.0
    while time.monotonic() < deadline_s:
        assert process.returncode is None, log_path.read_text()
        try:
            if (await _get(port, "/health/live"))[0] == 200:
                return
        except (OSError, asyncio.IncompleteReadError):
            await asyncio.sleep(0.2)
    raise AssertionError(f"the gateway did not start: {log_path.read_text()}")


async def _until_accepted(port: int) -> None:
    """Until the kernel holds no connection for the listening socket to accept (/proc/net/tcp: a listening
    socket's rx_queue is its accept backlog)."""
    deadline_s = time.monotonic() + DEADLINE_S
    while _accept_backlog(port):
        assert time.monotonic() < deadline_s, "the gateway stopped accepting"
        await asyncio.sleep(0.05)


def _accept_backlog(port: int) -> int:
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if fields[1].endswith(f":{port:04X}") and fields[3] == "0A":  # 0A: LISTEN
            return int(fields[4].split(":")[1], 16)
    return 0


def _send_long_request_line(port: int) -> int:
    """Send `GET /aaa...` (LONG_LINE_BYTES) as fast as the socket takes it; returns the bytes sent before the
    gateway closed the connection (all of them, and the rest of the request, if it never did)."""
    chunk = b"a" * 2**20
    with socket.create_connection(("127.0.0.1", port), timeout=3 * DEADLINE_S) as sock:  # a stalled gateway fails
        sent = 0
        try:
            sock.sendall(b"GET /")
            while sent < LONG_LINE_BYTES:
                sock.sendall(chunk)
                sent += len(chunk)
            sock.sendall(b" HTTP/1.1\r\nHost: x\r\n\r\n")
        except (BrokenPipeError, ConnectionResetError):
            pass
        return sent


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return float(times.user + times.system)


async def _get(port: int, path: str, *, headers: dict[str, str] | None = None) -> tuple[int, dict[str, str], bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(_request(path, headers or {}))
        return await _reply(reader)
    finally:
        writer.close()


async def _connection_with(port: int, key: str, *, expect_close: bool = False) -> tuple[
        int, tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A connection that sent one request with ``key``, left open; its status. With ``expect_close``, a 429
    with Retry-After that the gateway then closed."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request("/health/live", {"Authorization": f"Bearer {key}"}))
    status, headers, body = await asyncio.wait_for(_reply(reader), DEADLINE_S)
    if expect_close:
        assert headers["retry-after"] == "1" and headers["connection"] == "close"
        assert json.loads(body)["error"]["code"] == "too_many_connections"
        assert await asyncio.wait_for(reader.read(), DEADLINE_S) == b""
    return status, (reader, writer)


async def _until_status(port: int, key: str, status: int) -> None:
    deadline_s = time.monotonic() + DEADLINE_S
    while (answered := await _connection_with(port, key))[0] != status:
        answered[1][1].close()
        assert time.monotonic() < deadline_s, f"still {answered[0]}"
        await asyncio.sleep(0.05)


def _decode_legs(fake: FakeEngine) -> int:
    return sum(1 for body in fake.bodies if not (body.get("kv_transfer_params") or {}).get("do_remote_decode"))


def _completion(settings: Settings) -> bytes:
    body = json.dumps({"model": settings.model.served_name, "prompt": "hi", "max_tokens": 5, "stream": True}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n")
    return head.encode() + body


async def _until_in(reader: asyncio.StreamReader, marker: bytes) -> bytes:
    data = b""
    while marker not in data:
        part = await reader.read(65536)
        assert part, f"closed before {marker!r}: {data!r}"
        data += part
    return data


def _request(path: str, headers: dict[str, str]) -> bytes:
    lines = [f"GET {path} HTTP/1.1", "Host: 127.0.0.1", *(f"{name}: {value}" for name, value in headers.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


async def _reply(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 reply with a Content-Length: status, headers (lower-case names), body."""
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    status_line, *lines = head.removesuffix("\r\n\r\n").split("\r\n")
    headers: dict[str, Any] = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    body = await reader.readexactly(int(headers.get("content-length", 0)))
    return int(status_line.split()[1]), headers, body

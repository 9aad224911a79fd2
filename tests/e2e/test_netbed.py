"""PD across hosts: the gateway, the prefill engine and the decode engine each in a network namespace
of its own (tests/netbed.py, tests/netbed_pd.py), KV over NIXL/UCX across veth links, each host
configured as a user configures separate machines (engines by address). Then link faults on that bed.

Made and torn down here; skipped, with the reason, where namespaces cannot be made.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve.pd import decode, prefill
from pdserve.pd.kv import KVTransferParams
from tests import netbed
from tests.conftest import metric
from tests.netbed_pd import (
    EJECT_FOR_S,
    ENGINE_HEADERS,
    HOST_ENV,
    KV_PULL_TIMEOUT_S,
    LINK_TIMEOUT_S,
    PROMPT,
    Deployment,
    complete,
    deployed,
    recent,
    stream,
)

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif((reason := netbed.why_not()) is not None, reason=f"NO NETWORK BED: {reason}")]


LONG_TOKENS = 1900  # seconds of generation on the demo model, within its 2,048-token context
DEADLINE_S = 300.0  # for conditions the tests wait on: CI shares 2 cores
CUT_ATTEMPTS = 8  # requests to try before one is still on the decode engine when its link is cut


@pytest.fixture(scope="module")
def netem() -> None:
    """Skips where this kernel has no netem qdisc (probed once, on a throwaway bed of one host)."""
    if (reason := netbed.netem_missing()) is not None:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Deployment]:
    with deployed(tmp_path_factory.mktemp("netbed")) as made:
        yield made


def test_pd_across_hosts_equals_local_and_the_kv_crossed_the_link(deployment: Deployment) -> None:
    pd = complete(deployment, mode="pd", request_id="bed-pd")
    local = complete(deployment, mode="local", request_id="bed-local")
    assert pd["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    assert recent(deployment, "bed-pd")["prefill_url"] == deployment.url("prefill")
    stream(deployment, request_id="bed-pd-stream")
    assert recent(deployment, "bed-pd-stream")["kv"] == "pulled"  # the decode engine's usage says so


def test_verify_across_hosts_names_the_interface_and_fails_a_1_gbit_link(deployment: Deployment) -> None:
    """Run on the decode host: the interface toward its engine's peer is its eth0 (a veth: 10000 Mb/s).
    At the default bar (10% of 1.25 GB/s) a 1 Gbit/s link sits on the line itself; 15% keeps clear of it."""
    decode = deployment.bed.hosts["decode"]
    config = deployment.logs["decode"].with_name("decode.yaml")

    def verify() -> tuple[int, list[dict[str, Any]], str]:
        out = subprocess.run(decode.argv(sys.executable, "-m", "pdserve", "verify", "--config", str(config),
                                         "--gateway-url", deployment.gateway_url, "--json", "--probes", "2",
                                         "--min-fraction", "0.15"),
                             env={**os.environ, **HOST_ENV}, check=False, capture_output=True, text=True, timeout=600)
        return out.returncode, json.loads(out.stdout or "[]"), out.stderr

    code, unlimited, stderr = verify()
    assert unlimited, stderr
    assert unlimited[0]["interface"].startswith(f"{netbed.HOST_INTERFACE}, ")  # not loopback's
    before = live_kv(deployment)
    deployment.bed.rate_limit("prefill", rate_mbit=1000)
    try:
        code, limited, stderr = verify()
    finally:
        deployment.bed.clear_limits("prefill")
    after = live_kv(deployment)  # the live page's reading: the bytes over the seconds between two reads
    moved_bytes = after["kv"]["kv_bytes"] - before["kv"]["kv_bytes"]
    live_gbps = moved_bytes / (after["kv"]["kv_seconds"] - before["kv"]["kv_seconds"]) / 1e9
    assert live_gbps < after["kv_bar_gbps"], (live_gbps, after["kv_bar_gbps"])  # the page draws it under the bar
    (report,) = limited
    assert code == 1 and not report["ok"], report
    problems = " ".join(report["verdict"]["problems"])
    assert f"through {netbed.HOST_INTERFACE}" in problems and "check the link between the engines" in problems
    # 1 Gbit/s is 0.125 GB/s; tbf passes its burst (125 KB, netbed.rate_limit) above the rate, and a loaded
    # machine measured 0.1252: within 4% of the link, where the unshaped veth moves several times more
    assert report["verdict"]["measured_gbps"] < 0.13
    print(f"\nKV GB/s through veth: unlimited {unlimited[0]['verdict']['measured_gbps']:.3f}, "
          f"1 Gbit/s {report['verdict']['measured_gbps']:.3f}, on the live page {live_gbps:.3f}")


def test_a_partition_between_prefill_and_decode_recomputes_counts_and_ejects_until_mended(
        deployment: Deployment) -> None:
    """The pull across the cut link hangs (vLLM does not time it out); the gateway gives it up after
    kv_pull_timeout_s and the decode engine prefills the request itself."""
    with deployment.bed.cut_between("prefill", "decode"):
        started_s = time.monotonic()
        cut = stream(deployment, request_id="bed-cut")
        elapsed_s = time.monotonic() - started_s
        stream(deployment, request_id="bed-after-cut")
    assert cut.endswith(b"data: [DONE]\n\n") and b'"error"' not in cut
    assert elapsed_s < KV_PULL_TIMEOUT_S + 60  # within its deadline: no hang
    assert recent(deployment, "bed-cut")["kv"] == "recomputed"
    metrics = httpx.get(deployment.gateway_url + "/metrics", timeout=30).text
    assert 'pdserve_kv_recomputed_total{reason="pull_timeout"}' in metrics
    log = deployment.log("gateway")
    assert "request_id=bed-cut KV NOT PULLED (pull_timeout)" in log and "KV pulls failed in a row" in log
    # Ejected: the next request did not go to that prefill engine (the decode engine prefilled it alone).
    assert recent(deployment, "bed-after-cut")["prefill_url"] is None
    time.sleep(EJECT_FOR_S + 1)  # the pair is tried again, now that the link is back
    stream(deployment, request_id="bed-mended")
    assert recent(deployment, "bed-mended")["kv"] == "pulled"
    print(f"\nstream across the cut link: {elapsed_s:.1f} s")


@pytest.mark.parametrize("netem_args", [("delay", "1ms"), ("delay", "10ms"), ("loss", "1%")],
                         ids=["delay-1ms", "delay-10ms", "loss-1pct"])
def test_pd_across_links_with_latency_or_loss_equals_local_and_completes(
        netem: None, deployment: Deployment, netem_args: tuple[str, str]) -> None:
    """Both engine hosts' links (each delays or drops what it sends, so a KV read crosses two of them)."""
    tag = "-".join(netem_args).replace("%", "pct")
    for host in ("prefill", "decode"):
        deployment.bed.add_netem(host, *netem_args)
    try:
        pd = complete(deployment, mode="pd", request_id=f"bed-netem-{tag}")
        local = complete(deployment, mode="local", request_id=f"bed-netem-{tag}-local")
        stream(deployment, request_id=f"bed-netem-{tag}-stream")
    finally:
        for host in ("prefill", "decode"):
            deployment.bed.clear_limits(host)
    assert pd["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    assert recent(deployment, f"bed-netem-{tag}")["prefill_url"] == deployment.url("prefill")
    assert recent(deployment, f"bed-netem-{tag}-stream")["kv"] == "pulled"


def test_a_partition_between_gateway_and_decode_mid_stream_ends_it_with_an_error_event_and_its_record(
        deployment: Deployment) -> None:
    """One decode engine, so the stream has nowhere to move on to (with another it would, as for a killed
    engine: tests/e2e/test_faults.py): the silent link fails the stream's connection within
    link_timeout_s (silence alone keeps a stream with nowhere to go on its engine: gateway/relay.py), and the
    client gets one error event, not a hang.
    On a busy machine a client can read seconds behind its stream: a stream whose engine had sent it all
    before the cut must be whole and recorded ok, and the next one is cut."""
    for attempt in range(1, CUT_ATTEMPTS + 1):
        pd_record(deployment, f"bed-before-stream-cut-{attempt}")
        request_id = f"bed-stream-cut-{attempt}"
        events, elapsed_s = stream_cut_after_three_events(deployment, request_id)
        if b'"code": "decode_stream_failed"' in events:
            break
        assert events.endswith(b"data: [DONE]\n\n") and recent(deployment, request_id)["status"] == "ok", events[-500:]
    else:
        raise AssertionError(f"in {CUT_ATTEMPTS} streams the decode engine had always sent all before the cut")
    assert events.endswith(b"data: [DONE]\n\n"), events[-500:]
    assert events.count(b'"text"') < LONG_TOKENS  # cut mid-stream, not after it
    assert elapsed_s < 30 + 60  # the link or idle timeout, not a hang
    record = recent(deployment, request_id)
    assert record["status"] == "decode_stream_failed" and record["decode_url"] == deployment.url("decode")
    assert f"request_id={request_id} role=decode" in deployment.log("gateway")
    print(f"\nstream across a cut gateway-decode link ended after {elapsed_s:.1f} s (attempt {attempt})")


def stream_cut_after_three_events(deployment: Deployment, request_id: str) -> tuple[bytes, float]:
    """A long PD stream whose gateway-decode link is cut once the client has read three events (the
    decode engine's tokens flow; the first may be the prefill engine's), mended at its end: its bytes,
    and the seconds from the cut to its end."""
    events, started_s, is_cut = b"", time.monotonic(), False
    try:
        with httpx.stream("POST", deployment.gateway_url + "/v1/completions", json=long_body(stream=True),
                          headers={"X-PD-Mode": "pd", "X-Request-Id": request_id}, timeout=DEADLINE_S) as reply:
            for chunk in reply.iter_bytes():
                events += chunk
                if not is_cut and events.count(b"data: ") >= 3:
                    deployment.bed.cut("gateway", "decode")
                    started_s, is_cut = time.monotonic(), True
    finally:
        deployment.bed.mend("gateway", "decode")
    return events, time.monotonic() - started_s


def test_a_partition_between_gateway_and_decode_fails_a_whole_reply_within_the_link_timeout(
        deployment: Deployment) -> None:
    """A whole reply has no bytes before its end, so no idle timeout can tell a silent link: without
    gateway.link_timeout_s (TCP keepalive) it waited for request_timeout_s, an hour, and left no record.
    A reply that ends before the gateway is seen holding its decode leg is whole, and the next one is cut."""
    for attempt in range(1, CUT_ATTEMPTS + 1):
        pd_record(deployment, f"bed-before-whole-cut-{attempt}")
        request_id = f"bed-whole-cut-{attempt}"
        replies: list[httpx.Response | Exception] = []
        client = threading.Thread(target=post_whole, args=(deployment, request_id, replies))
        client.start()
        # Its decode leg is open and the engine still generates (the gateway counts a leg until it has relayed the
        # reply, which a busy machine makes long after the engine's end), or it ended.
        until(lambda running=client: not running.is_alive() or (
            legs_open(deployment, "decode") >= 1 and engine_running(deployment, "decode") >= 1),
              what="the decode leg open and generating")
        if not client.is_alive():
            (reply,) = replies
            assert isinstance(reply, httpx.Response) and reply.status_code == 200, reply
            continue
        deployment.bed.cut("gateway", "decode")
        started_s = time.monotonic()
        try:
            client.join(timeout=LINK_TIMEOUT_S + 150)
        finally:
            deployment.bed.mend("gateway", "decode")
        elapsed_s = time.monotonic() - started_s
        (reply,) = replies
        if isinstance(reply, httpx.Response) and reply.status_code == 200:
            continue  # it ended between the look and the cut
        break
    else:
        raise AssertionError(f"in {CUT_ATTEMPTS} whole replies none was still on the decode engine at the cut")
    assert isinstance(reply, httpx.Response), f"no answer: {reply!r}"
    assert reply.status_code in (502, 504) and request_id in reply.json()["error"]["message"], reply.text
    assert elapsed_s < LINK_TIMEOUT_S + 60
    assert recent(deployment, request_id)["status"] == "failed"
    print(f"\nwhole reply across a cut gateway-decode link failed after {elapsed_s:.1f} s (attempt {attempt})")


def post_whole(deployment: Deployment, request_id: str, replies: list[httpx.Response | Exception]) -> None:
    """A long whole (non-streamed) PD reply, its response or error appended to ``replies``."""
    try:
        replies.append(httpx.post(deployment.gateway_url + "/v1/completions", json=long_body(stream=False),
                                  headers={"X-PD-Mode": "pd", "X-Request-Id": request_id},
                                  timeout=LINK_TIMEOUT_S + 120))
    except httpx.HTTPError as exc:
        replies.append(exc)


def test_a_prefill_engine_restarted_at_its_address_is_a_new_nixl_engine_and_pulls_go_on(
        deployment: Deployment) -> None:
    """vLLM's decode side caches a prefill engine's handshake by its engine id: had the restarted engine
    kept its id, the decode engine would read through the dead engine's agent (the first pull fails and
    the pair is ejected: seen here before pdserve gave each start an id of its own)."""
    pd_record(deployment, "bed-before-restart")
    # The fault before may have left a warm-up pending: one that reached the engine as it stopped failed its
    # leg, and that ejection (a right one) counted against the restart.
    deployment.until_ready()
    before_id = nixl_engine_id(deployment)
    failed_before = gateway_metric(deployment, 'pdserve_kv_recomputed_total{reason="pull_failed"}')
    ejected_before = gateway_metric(deployment, 'pdserve_engine_ejections_total{role="prefill"}')
    deployment.restart_engines("prefill")
    assert nixl_engine_id(deployment) != before_id
    pd_record(deployment, "bed-after-restart")
    assert gateway_metric(deployment, 'pdserve_kv_recomputed_total{reason="pull_failed"}') == failed_before
    assert gateway_metric(deployment, 'pdserve_engine_ejections_total{role="prefill"}') == ejected_before
    pd = complete(deployment, mode="pd", request_id="bed-restarted-pd")
    local = complete(deployment, mode="local", request_id="bed-restarted-local")
    assert pd["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    assert recent(deployment, "bed-restarted-pd")["prefill_url"] == deployment.url("prefill")


def live_kv(deployment: Deployment) -> dict[str, Any]:
    """The live page's state once the gateway has read every KV transfer the decode engine counts."""
    def engine_transfers() -> float:
        text = httpx.get(deployment.url("decode") + "/metrics", headers=ENGINE_HEADERS, timeout=30).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("vllm:nixl_xfer_time_seconds_count"))

    def state() -> dict[str, Any]:
        reply = httpx.get(deployment.gateway_url + "/dashboard/state", timeout=30)
        reply.raise_for_status()
        return dict(reply.json())

    until(lambda: state()["kv"]["kv_transfers"] == engine_transfers(), what="the gateway to read the KV counters")
    return state()


def long_body(*, stream: bool) -> dict[str, Any]:
    return {"model": DEMO_MODEL_NAME, "prompt": PROMPT, "max_tokens": LONG_TOKENS, "temperature": 0,
            "ignore_eos": True, "stream": stream}


def until(condition: Any, *, what: str) -> None:
    deadline_s = time.monotonic() + DEADLINE_S
    while not condition():
        assert time.monotonic() < deadline_s, f"waited {DEADLINE_S:.0f} s for {what}"
        time.sleep(0.05)


def pd_record(deployment: Deployment, prefix: str) -> dict[str, Any]:
    """The record of the first of streamed PD requests sent one after another whose KV its prefill engine
    prefilled and its decode engine pulled: the bed serves PD again (after a fault's ejections, or a restart)."""
    deadline_s, attempt = time.monotonic() + DEADLINE_S, 0
    while time.monotonic() < deadline_s:
        attempt += 1
        request_id = f"{prefix}-{attempt}"
        reply = httpx.post(deployment.gateway_url + "/v1/completions", timeout=DEADLINE_S,
                           headers={"X-PD-Mode": "pd", "X-Request-Id": request_id},
                           json={**long_body(stream=True), "max_tokens": 4, "stream_options": {"include_usage": True}})
        if reply.status_code == 200 and (record := recent(deployment, request_id))["kv"] == "pulled":
            return record
        time.sleep(1)
    raise AssertionError(f"no PD request through the bed's prefill engine in {DEADLINE_S:.0f} s")


def nixl_engine_id(deployment: Deployment) -> str:
    """The prefill engine's NIXL engine id, from a prefill leg sent to it directly; its handoff given back."""
    body = {"model": DEMO_MODEL_NAME, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    handoff = httpx.post(deployment.url("prefill") + "/v1/completions", headers=ENGINE_HEADERS, timeout=120,
                         json=prefill.make_body(body, connector="NixlConnector")).json()["kv_transfer_params"]
    release = decode.make_release_body(KVTransferParams(fields=handoff, prompt_tokens=0))
    httpx.post(deployment.url("decode") + "/v1/completions", json=release, headers=ENGINE_HEADERS, timeout=120)
    engine_id: str = handoff["remote_engine_id"]
    return engine_id


def legs_open(deployment: Deployment, role: str) -> int:
    """Legs the gateway has open on the bed's ``role`` engine (/health lists them: the bed sets no keys)."""
    (engine,) = httpx.get(deployment.gateway_url + "/health", timeout=30).json()["engines"][role]
    legs: int = engine["in_flight"]
    return legs


def engine_running(deployment: Deployment, role: str) -> float:
    """Requests the bed's ``role`` engine is running, by its own count (vLLM's ``vllm:num_requests_running``)."""
    return metric(httpx.get(deployment.url(role) + "/metrics", headers=ENGINE_HEADERS, timeout=30).text,
                  "vllm:num_requests_running")


def gateway_metric(deployment: Deployment, series: str) -> float:
    return metric(httpx.get(deployment.gateway_url + "/metrics", timeout=30).text, series)


def test_a_whole_reply_whose_kv_pull_hangs_is_prefilled_by_its_decode_engine_after_kv_pull_timeout_s(
        deployment: Deployment) -> None:
    """A whole reply's headers come with its last token: it waited for request_timeout_s (an hour) where
    a stream gave the pull up after kv_pull_timeout_s. Now the decode engine's count of pending pulls
    tells it (gateway/whole_pull.py)."""
    pd_record(deployment, "bed-before-whole-pull")
    timeouts_before = gateway_metric(deployment, 'pdserve_kv_recomputed_total{reason="pull_timeout"}')
    local = complete(deployment, mode="local", request_id="bed-whole-pull-local")
    with deployment.bed.cut_between("prefill", "decode"):
        started_s = time.monotonic()
        pd = complete(deployment, mode="pd", request_id="bed-whole-pull")
        elapsed_s = time.monotonic() - started_s
    assert pd["choices"][0]["token_ids"] == local["choices"][0]["token_ids"]
    assert elapsed_s < KV_PULL_TIMEOUT_S + 60
    record = recent(deployment, "bed-whole-pull")
    assert record["kv"] == "recomputed" and record["prefill_url"] == deployment.url("prefill"), record
    assert gateway_metric(deployment, 'pdserve_kv_recomputed_total{reason="pull_timeout"}') == timeouts_before + 1
    assert "request_id=bed-whole-pull KV NOT PULLED (pull_timeout)" in deployment.log("gateway")
    print(f"\nwhole reply across a cut prefill-decode link: {elapsed_s:.1f} s")

"""``pdserve cloud status``: the NIXL backend each engine pod logged, why a Serve deployment failed, and the
kv-link row that times one PD request's KV by the decode engine's own counters.

The parsing is tested pure, the grep pattern against real ``grep``, and the whole path through the CLI
against the stand-in tools (eks_standins.py)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from pdserve.config import load_settings
from pdserve.deploy.cloud_status import (
    Check,
    backend_check,
    backend_grep_argv,
    exec_check,
    kv_link_check,
    kv_link_prompt_tokens,
)
from pdserve.deploy.cluster_view import deployment_causes, engine_pods
from pdserve.pd.transfer_stats import TransferCounters
from pdserve.verify.checks import ADVICE, Link
from tests.deploy.test_eks import Standins, cloud, standins  # noqa: F401

POD = "pdserve-raycluster-decode-worker-0"
# NIXL's lines as it prints them at NIXL_LOG_LEVEL=INFO (eks_standins.ENGINE_LOG cites their sources)
LIBFABRIC_LOG = """=== pdserve: starting decode-0: python -m vllm.entrypoints.openai.api_server
=== pdserve: kv buffer cpu: EFA without GPUDirect RDMA (no peermem module loaded)
=== pdserve: libfabric provider efa: placement.efa_devices=1
(ServeReplica:pdserve:decode pid=812) INFO 12-03 10:00:01 [__init__.py:40] Loading model
I1203 10:00:02.512310     812 libfabric_rail_manager.cpp:232] Created 1 rails using provider=efa
2026-12-03 10:00:02 NIXL INFO    _api.py:405 Backend LIBFABRIC was instantiated
"""
# what `grep -rhoaEs ... KV_PATH_PATTERN` prints for LIBFABRIC_LOG
LIBFABRIC_GREP = """=== pdserve: kv buffer cpu: EFA without GPUDirect RDMA (no peermem module loaded)
1 rails using provider=efa
Backend LIBFABRIC was instantiated
"""
DECODE_URL = "http://10.0.3.7:8200"
KV_BYTES_PER_TOKEN = 147456  # Qwen3-8B: 36 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes
BEFORE = {DECODE_URL: TransferCounters(bytes=4.0e8, seconds=0.2, transfers=12.0)}
PREFLIGHT = ("pdserve preflight: NIXL LIBFABRIC: fi_getinfo failed: No data available; memlock 64.0 KiB is below "
             "the 2.0 GiB the KV buffer pins")


def test_libfabric_instantiated_is_ok_with_its_provider_and_kv_buffer() -> None:
    check = backend_check(POD, LIBFABRIC_GREP, expected=["LIBFABRIC"])
    assert check == Check("nixl-backend", "OK", f"{POD}: LIBFABRIC (provider efa, kv buffer cpu)")


def test_provider_is_not_reported_when_nixl_did_not_log_the_one_it_opened() -> None:
    """pdserve's FI_PROVIDER note is what it asked for; the row reports only what NIXL said it opened."""
    without_rails = "".join(line + "\n" for line in LIBFABRIC_GREP.splitlines() if "rails" not in line)
    check = backend_check(POD, without_rails + "=== pdserve: libfabric provider efa: placement.efa_devices=1\n",
                          expected=["LIBFABRIC"])
    assert check == Check("nixl-backend", "OK", f"{POD}: LIBFABRIC (provider not reported, kv buffer cpu)")
    tcp = backend_check(POD, LIBFABRIC_GREP.replace("provider=efa", "provider=tcp"), expected=["LIBFABRIC"])
    assert tcp.detail == f"{POD}: LIBFABRIC (provider tcp, kv buffer cpu)"


def test_ucx_alone_where_libfabric_is_asked_fails_saying_nixl_fell_back() -> None:
    check = backend_check(POD, LIBFABRIC_GREP.replace("LIBFABRIC was", "UCX was"), expected=["LIBFABRIC"])
    assert check == Check("nixl-backend", "FAIL",
                          f"{POD}: UCX only: NIXL fell back to UCX, which runs at TCP speed on EFA")


def test_no_backend_line_fails_saying_none_was_instantiated() -> None:
    notes_only = "\n".join(LIBFABRIC_GREP.splitlines()[:2])
    for output in ("", notes_only):
        check = backend_check(POD, output, expected=["LIBFABRIC"])
        assert check == Check("nixl-backend", "FAIL", f"{POD}: no NIXL backend was instantiated (no 'Backend ... "
                                                      "was instantiated' line in its logs)")


def test_ucx_asked_and_instantiated_is_ok_without_a_provider() -> None:
    check = backend_check(POD, "Backend UCX was instantiated\n", expected=["UCX"])
    assert (check.result, check.detail) == ("OK", f"{POD}: UCX")


def test_grep_finding_nothing_fails_but_kubectl_failing_to_ask_is_skipped_with_its_error() -> None:
    no_match = exec_check(POD, exit_code=1, stdout="", stderr="command terminated with exit code 1\n",
                          expected=["LIBFABRIC"])
    assert no_match.result == "FAIL" and "no NIXL backend" in no_match.detail
    # grep exits 2 when a path is missing, yet prints what it found in the others
    partial = exec_check(POD, exit_code=2, stdout=LIBFABRIC_GREP, stderr="command terminated with exit code 2\n",
                         expected=["LIBFABRIC"])
    assert partial.result == "OK"
    forbidden = ('Error from server (Forbidden): pods "decode-0" is forbidden: User "dev" cannot create resource '
                 '"pods/exec" in API group "" in the namespace "serving"')
    refused = exec_check(POD, exit_code=1, stdout="", stderr=forbidden + "\n", expected=["LIBFABRIC"])
    assert refused == Check("nixl-backend", "SKIPPED", f"{POD}: kubectl exec gave no answer from grep: {forbidden}")
    no_grep = exec_check(POD, exit_code=126, stdout="", stderr="command terminated with exit code 126\n",
                         expected=["LIBFABRIC"])
    assert no_grep.result == "SKIPPED"


def test_the_grep_pattern_keeps_every_line_the_parser_needs_and_skips_sockets(tmp_path: Path) -> None:
    """Real grep over a Ray-like tree: NIXL's line, pdserve's notes, a log with a stray NUL, a socket-like FIFO."""
    settings = load_settings(None, overrides={"launch.log_dir": str(tmp_path / "engines")})
    argv = backend_grep_argv(settings, POD)
    assert argv[:2] == ("kubectl", "--context") and argv[-2:] == ("/tmp/ray/", str(tmp_path / "engines"))
    assert argv[3:argv.index("--")] == ("exec", "--namespace", settings.kubernetes.namespace, POD, "-c", "ray-worker")
    (tmp_path / "engines").mkdir()
    (tmp_path / "engines" / "decode-0-abc.log").write_text(LIBFABRIC_LOG.replace("(ServeReplica", "\0(ServeReplica"))
    (tmp_path / "sockets").mkdir()
    subprocess.run(["mkfifo", str(tmp_path / "sockets" / "raylet")], check=True)
    grep = [*argv[argv.index("--") + 1:-2], str(tmp_path / "sockets"), str(tmp_path / "engines")]
    found = subprocess.run(grep, capture_output=True, text=True, timeout=10, check=False)
    assert found.returncode == 0, found.stderr
    assert found.stdout == LIBFABRIC_GREP


def test_failed_and_unhealthy_deployments_each_say_why_with_the_preflight_line_first() -> None:
    deploy_failed = ("The deployment failed to start 3 times in a row. This may be due to a problem with its "
                     "constructor or initial health check failing. See controller logs for details. Error:\n"
                     "Traceback (most recent call last):\n  File \"engine_replica.py\", line 76, in __init__\n"
                     f"pdserve.errors.EngineStartFailed: {PREFLIGHT}\n")
    unhealthy = ("Replica(id='abc') failed health check:\npdserve.errors.EngineStartFailed: prefill-0 exited:\n"
                 "torch.OutOfMemoryError: CUDA out of memory")
    rayservice = {"status": {"pendingServiceStatus": {"applicationStatuses": {"pdserve": {
        "status": "DEPLOYING", "serveDeploymentStatuses": {
            "prefill": {"status": "UNHEALTHY", "message": unhealthy},
            "decode": {"status": "DEPLOY_FAILED", "message": deploy_failed},
            "gateway": {"status": "HEALTHY"}}}}}}}
    assert deployment_causes(json.dumps(rayservice)) == [
        f"deployment pdserve/decode DEPLOY_FAILED: pdserve.errors.EngineStartFailed: {PREFLIGHT}",
        "deployment pdserve/prefill UNHEALTHY: pdserve.errors.EngineStartFailed: prefill-0 exited: ... torch.OutOfMemoryError: CUDA out of memory",
    ]
    assert deployment_causes(json.dumps({"status": {}})) == []


def test_engine_pods_are_the_running_prefill_and_decode_pods_of_this_deployment() -> None:
    def pod(name: str, component: str, *, instance: str = "pdserve", phase: str = "Running") -> dict[str, object]:
        labels = {"app.kubernetes.io/instance": instance, "app.kubernetes.io/component": component}
        return {"metadata": {"name": name, "labels": labels}, "status": {"phase": phase}}

    pods = [pod("head", "head"), pod("prefill-0", "prefill"), pod("decode-0", "decode"),
            pod("decode-1", "decode", phase="Pending"), pod("other-decode-0", "decode", instance="other")]
    assert engine_pods(json.dumps({"items": pods}), instance="pdserve") == ["prefill-0", "decode-0"]


def test_status_confirms_libfabric_from_each_engine_pods_own_logs(standins: Standins) -> None:  # noqa: F811
    assert cloud(standins, "up").exit_code == 0
    standins.forget_calls()
    result = cloud(standins, "status")
    assert result.exit_code == 0, result.output
    for role in ("prefill", "decode"):
        assert re.search(rf"nixl-backend\s+OK\s+pdserve-raycluster-{role}-worker-0: LIBFABRIC "
                         r"\(provider efa, kv buffer cpu\)", result.output), result.output
    execs = [call for call in standins.calls() if call["words"][:1] == ["exec"]]
    assert len(execs) == 2
    assert sorted(call["words"][3] for call in execs) == [f"pdserve-raycluster-{role}-worker-0"
                                                          for role in ("decode", "prefill")]
    assert all("--context" in call["argv"] and call["words"][4:6] == ["-c", "ray-worker"] for call in execs)


@pytest.mark.parametrize(("provider", "shown"), [("tcp", "provider tcp"), ("", "provider not reported")],
                         ids=["nixl-said-tcp", "nixl-silent"])
def test_status_reports_the_provider_nixl_logged_not_the_one_pdserve_set(
    standins: Standins, monkeypatch: pytest.MonkeyPatch, provider: str, shown: str,  # noqa: F811
) -> None:
    """The pods run with FI_PROVIDER=efa and pdserve's note says so; the row says what NIXL reported."""
    assert cloud(standins, "up").exit_code == 0
    monkeypatch.setenv("STANDIN_NIXL_PROVIDER", provider)
    result = cloud(standins, "status")
    assert re.search(rf"nixl-backend\s+OK\s+pdserve-raycluster-decode-worker-0: LIBFABRIC \({shown}, kv buffer cpu\)",
                     result.output), result.output


def test_status_fails_when_an_engine_fell_back_to_ucx(standins: Standins, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                      ) -> None:
    assert cloud(standins, "up").exit_code == 0
    monkeypatch.setenv("STANDIN_NIXL_BACKEND", "UCX")
    result = cloud(standins, "status")
    assert result.exit_code == 1, result.output
    assert re.search(r"nixl-backend\s+FAIL\s+pdserve-raycluster-decode-worker-0: UCX only: NIXL fell back to UCX, "
                     r"which runs at TCP speed on EFA", result.output), result.output


def after_probe(*, gbps: float, prompt_tokens: int = 3072, failed: float = 0.0) -> dict[str, TransferCounters]:
    """BEFORE plus one transfer of ``prompt_tokens`` tokens' KV at ``gbps``."""
    kv_bytes = prompt_tokens * KV_BYTES_PER_TOKEN
    moved = TransferCounters(bytes=kv_bytes, seconds=kv_bytes / (gbps * 1e9), transfers=1.0, failed=failed)
    return {DECODE_URL: BEFORE[DECODE_URL].plus(moved)}


def test_kv_link_reports_the_probes_own_transfer_not_the_totals() -> None:
    check = kv_link_check(BEFORE, after_probe(gbps=3.1), bar_gbps=0.5, prompt_tokens=3072, waited_s=15)
    assert check == Check("kv-link", "OK", f"{DECODE_URL}: 453.0 MB in 1 transfer at 3.1 GB/s (prompt 3072 tokens)")


def test_kv_link_under_slow_kv_gbps_fails_saying_to_check_libfabric_on_efa() -> None:
    check = kv_link_check(BEFORE, after_probe(gbps=0.3), bar_gbps=0.5, prompt_tokens=3072, waited_s=15)
    assert check.result == "FAIL"
    assert check.detail.startswith(f"{DECODE_URL}: 453.0 MB in 1 transfer at 0.3 GB/s (prompt 3072 tokens), "
                                   "under gateway.slow_kv_gbps 0.5 GB/s. ")
    assert ADVICE[Link.NETWORK] in check.detail and "`fi_info -p efa`" in check.detail


def test_kv_link_with_a_failed_transfer_fails_even_when_fast() -> None:
    check = kv_link_check(BEFORE, after_probe(gbps=3.1, failed=1.0), bar_gbps=0.5, prompt_tokens=3072, waited_s=15)
    assert check.result == "FAIL"
    assert check.detail.startswith(f"{DECODE_URL}: 1 KV transfer(s) failed (prompt 3072 tokens). ")
    assert ADVICE[Link.NETWORK] in check.detail


def test_kv_link_without_a_new_transfer_is_skipped_saying_the_prompt_was_recomputed() -> None:
    for after in (BEFORE, {}):  # the counters did not move; the gateway has read no engine yet
        check = kv_link_check(BEFORE, after, bar_gbps=0.5, prompt_tokens=3072, waited_s=15)
        assert check == Check("kv-link", "SKIPPED", "no decode engine counted a KV transfer within 15 s of a "
                                                    "3072-token PD request: it recomputed the prompt instead (is "
                                                    "the KV connector set on both engines?)")


def test_kv_link_judges_the_engine_that_moved_most_when_others_serve_traffic_too() -> None:
    other = "http://10.0.3.8:8200"
    before = {**BEFORE, other: TransferCounters(bytes=1e6, seconds=1.0, transfers=1.0)}
    after = {**after_probe(gbps=3.1), other: TransferCounters(bytes=2e6, seconds=2.0, transfers=2.0)}
    check = kv_link_check(before, after, bar_gbps=0.5, prompt_tokens=3072, waited_s=15)
    assert (check.result, check.detail.split(":")[:2]) == ("OK", ["http", "//10.0.3.7"])


def test_kv_link_prompt_leaves_room_for_the_output_token_up_to_3072() -> None:
    assert [kv_link_prompt_tokens(length) for length in (2048, 3136, 32768)] == [1984, 3072, 3072]


@pytest.mark.parametrize(("env", "exit_code", "row"), [
    # 3072 tokens x 147,456 bytes at the stand-in's 3 GB/s
    ({"PDSERVE_MODEL__MAX_MODEL_LEN": "4096"}, 0,
     r"kv-link\s+OK\s+http://10\.0\.3\.7:8200: 453\.0 MB in 1 transfer at 3 GB/s \(prompt 3072 tokens\)"),
    ({"STANDIN_KV_GBPS": "0.2"}, 1,
     (r"kv-link\s+FAIL\s+http://10\.0\.3\.7:8200: 292\.6 MB in 1 transfer at 0\.2 GB/s \(prompt 1984 tokens\), under "
     r"gateway\.slow_kv_gbps 0\.5 GB/s\. use NIXL's LIBFABRIC")),
], ids=["measured", "too-slow"])
def test_status_measures_the_kv_link_with_one_long_pd_request(
    standins: Standins, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], exit_code: int, row: str,  # noqa: F811
) -> None:
    assert cloud(standins, "up").exit_code == 0
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = cloud(standins, "status")
    assert result.exit_code == exit_code, result.output
    assert re.search(row, result.output), result.output

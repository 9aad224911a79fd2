"""``pdserve cloud status``: the NIXL backend each engine pod logged, why a Serve deployment failed, and the
kv-link row that times PD requests' KV by the decode engine's own counters (its pure parts:
test_kv_link_row.py).

The parsing is tested pure, the grep pattern against real ``grep``, and the whole path through the CLI
against the stand-in tools (eks_standins.py)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from pdserve.config import load_settings
from pdserve.deploy.cloud_status import backend_check, backend_grep_argv, exec_check
from pdserve.deploy.cluster_view import Check, deployment_causes, engine_pods
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
    tcp = LIBFABRIC_GREP.replace("provider=efa", "provider=tcp")
    assert backend_check(POD, tcp, expected=["LIBFABRIC"]).detail == f"{POD}: LIBFABRIC (provider tcp, kv buffer cpu)"


def test_libfabric_over_another_provider_where_efa_is_placed_fails_naming_it() -> None:
    tcp = backend_check(POD, LIBFABRIC_GREP.replace("provider=efa", "provider=tcp"), expected=["LIBFABRIC"],
                        provider="efa")
    assert tcp.result == "FAIL"
    assert tcp.detail.startswith(f"{POD}: LIBFABRIC (provider tcp, kv buffer cpu): NIXL opened libfabric's tcp "
                                 "provider, not efa (")
    assert backend_check(POD, LIBFABRIC_GREP, expected=["LIBFABRIC"], provider="efa").result == "OK"


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


@pytest.mark.parametrize(("provider", "result_word", "detail"), [
    ("tcp", "FAIL", "(provider tcp, kv buffer cpu): NIXL opened libfabric's tcp provider, not efa"),
    ("", "OK", "(provider not reported, kv buffer cpu)"),
], ids=["nixl-said-tcp", "nixl-silent"])
def test_status_reports_the_provider_nixl_logged_not_the_one_pdserve_set(
    standins: Standins, monkeypatch: pytest.MonkeyPatch, provider: str, result_word: str, detail: str,  # noqa: F811
) -> None:
    """The pods run with FI_PROVIDER=efa and pdserve's note says so; the row says what NIXL reported."""
    assert cloud(standins, "up").exit_code == 0
    monkeypatch.setenv("STANDIN_NIXL_PROVIDER", provider)
    result = cloud(standins, "status")
    assert re.search(rf"nixl-backend\s+{result_word}\s+pdserve-raycluster-decode-worker-0: LIBFABRIC "
                     + re.escape(detail), result.output), result.output


def test_status_fails_when_an_engine_fell_back_to_ucx(standins: Standins, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                      ) -> None:
    assert cloud(standins, "up").exit_code == 0
    monkeypatch.setenv("STANDIN_NIXL_BACKEND", "UCX")
    result = cloud(standins, "status")
    assert result.exit_code == 1, result.output
    assert re.search(r"nixl-backend\s+FAIL\s+pdserve-raycluster-decode-worker-0: UCX only: NIXL fell back to UCX, "
                     r"which runs at TCP speed on EFA", result.output), result.output


@pytest.mark.parametrize(("env", "exit_code", "row"), [
    # the example's model (stand-in defaults: Qwen3.5-9B, 32,768 bytes per token and 51.5 MB of state) at EFA's
    # 3 GB/s: 512 tokens, then 3,000 (bytes per token read through the origin), then 10,636 from the two
    ({"PDSERVE_MODEL__MAX_MODEL_LEN": "16384"}, 0,
     (r"kv-link\s+OK\s+http://10\.0\.3\.7:8200: 400\.0 MB in 1 transfer at 3 GB/s \(prompt 10636 tokens\), over "
     r"one TCP flow's 1\.25 GB/s on g6\.8xlarge \(its EFA: 3\.12 GB/s\)")),
    # Qwen3-8B's KV, 147,456 bytes per token and no state: 512 tokens, then 2,713
    ({"PDSERVE_MODEL__MAX_MODEL_LEN": "16384", "STANDIN_KV_BYTES_PER_TOKEN": "147456", "STANDIN_KV_STATE_BYTES": "0"},
     0, r"kv-link\s+OK\s+http://10\.0\.3\.7:8200: 400\.0 MB in 1 transfer at 3 GB/s \(prompt 2713 tokens\)"),
    # the model's context caps the probe: 4096 - 64 tokens
    ({"PDSERVE_MODEL__MAX_MODEL_LEN": "4096"}, 0,
     r"kv-link\s+OK\s+http://10\.0\.3\.7:8200: 183\.6 MB in 1 transfer at 3 GB/s \(prompt 4032 tokens\)"),
    # TCP speed on a g6.8xlarge: under one TCP flow's ceiling, where the fixed 0.5 GB/s bar passed it
    ({"STANDIN_KV_GBPS": "1.1"}, 1,
     (r"kv-link\s+FAIL\s+http://10\.0\.3\.7:8200: 116\.5 MB in 1 transfer at 1\.1 GB/s \(prompt 1984 tokens\), no "
      r"faster than one TCP flow's 1\.25 GB/s on g6\.8xlarge \(its EFA: 3\.12 GB/s\): the KV fell back to TCP over "
      r"the node's ENA: check")),
], ids=["qwen3.5-9b", "qwen3-8b", "capped", "tcp-speed"])
def test_status_measures_the_kv_link_with_probes_sized_from_what_the_model_moves(
    standins: Standins, monkeypatch: pytest.MonkeyPatch, env: dict[str, str], exit_code: int, row: str,  # noqa: F811
) -> None:
    assert cloud(standins, "up").exit_code == 0
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    result = cloud(standins, "status")
    assert result.exit_code == exit_code, result.output
    assert re.search(row, result.output), result.output

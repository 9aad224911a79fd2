"""``pdserve cloud status``: the NIXL backend each engine pod logged, and why a Serve deployment failed.

The parsing is tested pure, the grep pattern against real ``grep``, and the whole path through the CLI
against the stand-in tools (eks_standins.py)."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from pdserve.config import load_settings
from pdserve.deploy.cloud_status import Check, backend_check, backend_grep_argv, exec_check
from pdserve.deploy.cluster_view import deployment_causes, engine_pods
from tests.deploy.test_eks import Standins, cloud, standins  # noqa: F401

POD = "pdserve-raycluster-decode-worker-0"
LIBFABRIC_LOG = """=== pdserve: starting decode-0: python -m vllm.entrypoints.openai.api_server
=== pdserve: kv buffer cpu: EFA without GPUDirect RDMA (no peermem module loaded)
=== pdserve: libfabric provider efa: placement.efa_devices=1
(ServeReplica:pdserve:decode pid=812) INFO 12-03 10:00:01 [__init__.py:40] Loading model
2026 NIXL INFO _api.py:405 Backend LIBFABRIC was instantiated
"""
# what `grep -rhoaEs ... KV_PATH_PATTERN` prints for LIBFABRIC_LOG
LIBFABRIC_GREP = """=== pdserve: kv buffer cpu: EFA without GPUDirect RDMA (no peermem module loaded)
=== pdserve: libfabric provider efa: placement.efa_devices=1
Backend LIBFABRIC was instantiated
"""
PREFLIGHT = ("pdserve preflight: NIXL LIBFABRIC: fi_getinfo failed: No data available; memlock 64.0 KiB is below "
             "the 2.0 GiB the KV buffer pins")


def test_libfabric_instantiated_is_ok_with_its_provider_and_kv_buffer() -> None:
    check = backend_check(POD, LIBFABRIC_GREP, expected=["LIBFABRIC"])
    assert check == Check("nixl-backend", "OK", f"{POD}: LIBFABRIC (provider efa, kv buffer cpu)")


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
    assert sorted(call["words"][3] for call in execs) == [f"pdserve-raycluster-{role}-worker-0"
                                                          for role in ("decode", "prefill")]
    assert all("--context" in call["argv"] and call["words"][4:6] == ["-c", "ray-worker"] for call in execs)


def test_status_fails_when_an_engine_fell_back_to_ucx(standins: Standins, monkeypatch: pytest.MonkeyPatch,  # noqa: F811
                                                      ) -> None:
    assert cloud(standins, "up").exit_code == 0
    monkeypatch.setenv("STANDIN_NIXL_BACKEND", "UCX")
    result = cloud(standins, "status")
    assert result.exit_code == 1, result.output
    assert re.search(r"nixl-backend\s+FAIL\s+pdserve-raycluster-decode-worker-0: UCX only: NIXL fell back to UCX, "
                     r"which runs at TCP speed on EFA", result.output), result.output

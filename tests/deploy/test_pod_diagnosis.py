"""Why pods wait, read from kubectl's JSON: what stops ``cloud up`` at once and what it waits for."""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

from pdserve.deploy.pod_diagnosis import cause_line, diagnose
from pdserve.engines.start_failure import describe_failure
from tests.engines.test_start_failure import STAND_IN

FIT_ERROR = ("0/3 nodes are available: 1 node(s) didn't match Pod's node affinity/selector, 2 Insufficient "
             "vpc.amazonaws.com/efa. preemption: 0/3 nodes are available: 3 Preemption is not helpful for scheduling.")


def node(name: str, *, efa: str = "1", cpu: str = "31850m", labels: dict[str, str] | None = None) -> dict[str, Any]:
    return {"kind": "Node", "metadata": {"name": name, "labels": labels or {"pool": "gpu"}},
            "status": {"allocatable": {"cpu": cpu, "memory": "120Gi", "vpc.amazonaws.com/efa": efa}}}


def pending_pod(name: str, message: str = FIT_ERROR) -> dict[str, Any]:
    container = {"resources": {"requests": {"cpu": "24", "memory": "96Gi", "vpc.amazonaws.com/efa": 1}}}
    return {"kind": "Pod", "metadata": {"name": name}, "spec": {"nodeSelector": {"pool": "gpu"}, "containers": [container]},
            "status": {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                           "reason": "Unschedulable", "message": message}]}}


def rayservice(**status: Any) -> dict[str, Any]:
    return {"kind": "RayService", "metadata": {"name": "pdserve"}, "status": status}


def look(*items: dict[str, Any]) -> Any:
    return diagnose(json.dumps({"kind": "List", "items": list(items)}), rayservice_name="pdserve")


def test_insufficient_efa_with_no_node_offering_any_is_a_blocker_with_the_plugin_fix() -> None:
    readiness = look(rayservice(), pending_pod("decode-0"), node("gpu-a", efa="0"), node("gpu-b", efa="0"))
    assert not readiness.is_ready
    assert f"pod decode-0: Pending: {FIT_ERROR}" in readiness.summary
    assert "the EFA device plugin (DaemonSet aws-efa-k8s-device-plugin in kube-system)" in readiness.blocker


def test_insufficient_efa_that_another_pod_holds_is_waited_for() -> None:
    readiness = look(rayservice(), pending_pod("decode-0"), node("gpu-a"), node("gpu-b"))
    assert "Insufficient vpc.amazonaws.com/efa" in readiness.summary and readiness.blocker == ""


def test_the_latest_failed_scheduling_event_is_the_cause_shown() -> None:
    event = {"kind": "Event", "reason": "FailedScheduling", "message": "0/3 nodes are available: 3 Insufficient cpu.",
             "involvedObject": {"name": "decode-0"}, "lastTimestamp": "2026-12-03T10:00:00Z"}
    older = {**event, "message": "0/3 nodes are available: 3 Insufficient memory.", "lastTimestamp": "2026-12-03T09:00:00Z"}
    readiness = look(rayservice(), pending_pod("decode-0"), older, event, node("gpu-a", cpu="15850m"))
    assert "Pending: 0/3 nodes are available: 3 Insufficient cpu." in readiness.summary
    assert "requests 24 of cpu but its nodes offer at most 15.85" in readiness.blocker
    assert look(rayservice(), pending_pod("decode-0"), event, node("gpu-a")).blocker == ""  # room once others go


def test_a_message_it_cannot_read_is_shown_and_waited_for() -> None:
    readiness = look(rayservice(), pending_pod("decode-0", message="waiting for a volume"), node("gpu-a"))
    assert "waiting for a volume" in readiness.summary and readiness.blocker == ""


def test_no_node_with_the_pods_labels_is_a_blocker() -> None:
    readiness = look(rayservice(), pending_pod("decode-0"), node("sys", labels={"pool": "system"}))
    assert "no node carries the labels {'pool': 'gpu'}" in readiness.blocker


def test_an_image_that_cannot_be_pulled_and_a_crash_loop_are_blockers() -> None:
    pulling = {"kind": "Pod", "metadata": {"name": "head-0"}, "spec": {"containers": [{}]}, "status": {
        "phase": "Pending", "containerStatuses": [{"state": {"waiting": {
            "reason": "ImagePullBackOff", "message": 'Back-off pulling image "pdserve:9"'}}}]}}
    crashing = {"kind": "Pod", "metadata": {"name": "decode-0"}, "spec": {"containers": [{}]}, "status": {
        "phase": "Running", "containerStatuses": [{"state": {"waiting": {"reason": "CrashLoopBackOff"}},
                                                    "lastState": {"terminated": {"exitCode": 137, "reason": "OOMKilled"}}}]}}
    readiness = look(rayservice(), pulling, crashing)
    assert "pod head-0: ImagePullBackOff: Back-off pulling image \"pdserve:9\"" in readiness.summary
    assert "the node cannot pull kubernetes.image" in readiness.blocker
    assert "CrashLoopBackOff: exit 137 OOMKilled" in readiness.summary
    assert "kubectl logs decode-0 --previous" in readiness.blocker


def test_a_serve_deployment_that_gave_up_stops_the_wait_with_its_preflight_line() -> None:
    message = ("The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n  ...\n"
               "pdserve.errors.EngineStartFailed: pdserve preflight: memlock (ulimit -l) is 8 MiB but NIXL must pin 20 GiB\n")
    status = {"pendingServiceStatus": {"applicationStatuses": {"pdserve": {"status": "DEPLOY_FAILED",
              "serveDeploymentStatuses": {"decode": {"status": "DEPLOY_FAILED", "message": message}}}}}}
    readiness = look(rayservice(**status))
    assert readiness.blocker == ("deployment pdserve/decode DEPLOY_FAILED: pdserve.errors.EngineStartFailed: pdserve "
                                 "preflight: memlock (ulimit -l) is 8 MiB but NIXL must pin 20 GiB")
    assert cause_line("first\nlast\n") == "last"
    exited = "Traceback ...\npdserve.errors.EngineStartFailed: decode-0 exited:\nINFO loading\nRuntimeError: CUDA out of memory"
    assert cause_line(exited) == "pdserve.errors.EngineStartFailed: decode-0 exited: ... RuntimeError: CUDA out of memory"


def test_ready_when_kuberay_says_so_and_absent_until_applied() -> None:
    assert look(rayservice(conditions=[{"type": "Ready", "status": "True"}])).is_ready
    assert look().summary == "RayService pdserve not created yet"


def test_a_worker_whose_wait_gcs_ready_cannot_pull_the_image_is_a_blocker() -> None:
    """KubeRay's init container runs the worker's image: its pull fails first, while the Ray container waits
    in PodInitializing."""
    worker = {"kind": "Pod", "metadata": {"name": "decode-0"}, "spec": {"containers": [{}]}, "status": {
        "phase": "Pending",
        "initContainerStatuses": [{"name": "wait-gcs-ready", "state": {"waiting": {
            "reason": "ErrImagePull", "message": "rpc error: code = NotFound desc = ...: not found"}}}],
        "containerStatuses": [{"name": "ray-worker", "state": {"waiting": {"reason": "PodInitializing"}}}]}}
    readiness = look(rayservice(), worker)
    assert "pod decode-0: ErrImagePull: rpc error: code = NotFound" in readiness.blocker


def test_a_pull_the_runtime_refuses_is_a_blocker_too() -> None:
    """The reasons the kubelet takes from the runtime's error (image_manager.go evalCRIPullErr)."""
    for reason in ("RegistryUnavailable", "SignatureValidationFailed", "ErrImageNeverPull"):
        pod = {"kind": "Pod", "metadata": {"name": "head-0"}, "spec": {"containers": [{}]}, "status": {
            "phase": "Pending", "containerStatuses": [{"state": {"waiting": {"reason": reason, "message": "m"}}}]}}
        assert f"pod head-0: {reason}: m" in look(rayservice(), pod).blocker


def test_a_pod_kept_off_nodes_still_coming_up_is_waited_for() -> None:
    """A node's not-ready and uninitialized taints go once it is Ready: no blocker, unlike a lasting taint."""
    coming_up = ("0/2 nodes are available: 2 node(s) had untolerated taint {node.kubernetes.io/not-ready: }. "
                 "preemption: 0/2 nodes are available: 2 Preemption is not helpful for scheduling.")
    assert look(rayservice(), pending_pod("decode-0", coming_up), node("gpu-a")).blocker == ""
    lasting = coming_up.replace("node.kubernetes.io/not-ready", "dedicated")
    assert "tolerates the pod" in look(rayservice(), pending_pod("decode-0", lasting), node("gpu-a")).blocker


def test_an_engine_that_failed_to_start_shows_its_root_cause_and_pdserves_fix() -> None:
    """Serve's message holds the replica's exception: pdserve's line names the root cause of the engine's log
    (engines/start_failure.py) and the fix follows; a raw vLLM traceback gives its root cause, not the
    "See root cause above" line that ends it."""
    vllm_log = subprocess.run([sys.executable, str(STAND_IN), "host-buffer"], capture_output=True, text=True,
                              check=False).stdout
    ours = (f"The deployment failed to start 3 times in a row.\nTraceback (most recent call last):\n  ...\n"
            f"pdserve.errors.EngineStartFailed: prefill-0 exited during start-up: {describe_failure(vllm_log)}\n"
            f"  log /tmp/pdserve/logs/prefill-0.log, its last lines:\n{vllm_log}")
    line, fix = cause_line(ours).splitlines()
    assert line.startswith("pdserve.errors.EngineStartFailed: prefill-0 exited during start-up: AttributeError: "
                           "'list' object has no attribute 'shape' (in initialize_host_xfer_buffer")
    assert fix.strip().startswith("fix: ") and "kv.buffer_device: cuda" in fix
    assert cause_line(vllm_log).startswith("AttributeError: 'list' object has no attribute 'shape'")

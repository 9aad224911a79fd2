"""The checks ``cloud up`` makes before it applies anything, on kubectl's and eksctl's JSON."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from pdserve.config import Settings, load_settings
from pdserve.deploy.eksctl import cluster_config, node_group_state, unresolved_zones
from pdserve.deploy.preflight import (
    efa_plugin_tolerations,
    gpu_nodes_readiness,
    image_check_pod,
    image_check_readiness,
    ray_version_problem,
)
from pdserve.errors import ConfigError, DeployError

EKS_EXAMPLE = Path(__file__).parents[2] / "examples" / "eks-g6-efa.yaml"
GPU_TAINT = {"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}
# eksctl's own tolerations for its EFA device plugin (eksctl pkg/addons/assets/efa-device-plugin.yaml)
EKSCTL_TOLERATIONS = [{"key": "CriticalAddonsOnly", "operator": "Exists"},
                      {"key": "aws.amazon.com/efa", "operator": "Exists", "effect": "NoSchedule"}]
EFA_TYPES = {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
    {"matchExpressions": [{"key": "node.kubernetes.io/instance-type", "operator": "In", "values": ["g6.8xlarge"]}]}]}}}


def settings() -> Settings:
    return load_settings(EKS_EXAMPLE)


def gpu_node(name: str, *, gpus: str = "1", efa: str = "1", instance_type: str = "g6.8xlarge",
             taints: tuple[dict[str, str], ...] = (), is_ready: bool = True) -> dict[str, Any]:
    labels = {"eks.amazonaws.com/nodegroup": "gpu", "node.kubernetes.io/instance-type": instance_type}
    return {"kind": "Node", "metadata": {"name": name, "labels": labels}, "spec": {"taints": [GPU_TAINT, *taints]},
            "status": {"allocatable": {"nvidia.com/gpu": gpus, "vpc.amazonaws.com/efa": efa},
                       "conditions": [{"type": "Ready", "status": str(is_ready)}]}}


def efa_plugin(tolerations: list[dict[str, str]], *, host_network: bool = False) -> dict[str, Any]:
    spec = {"tolerations": tolerations, "affinity": EFA_TYPES, **({"hostNetwork": True} if host_network else {})}
    return {"kind": "DaemonSet", "metadata": {"name": "aws-efa-k8s-device-plugin"}, "spec": {"template": {"spec": spec}}}


def plugin_pod(node: str, phase: str = "Running") -> dict[str, Any]:
    return {"kind": "Pod", "metadata": {"name": f"efa-{node}", "labels": {"name": "aws-efa-k8s-device-plugin"}},
            "spec": {"nodeName": node}, "status": {"phase": phase}}


def readiness(*items: dict[str, Any]) -> Any:
    return gpu_nodes_readiness(json.dumps({"kind": "List", "items": list(items)}), settings=settings())


def test_ready_when_both_gpu_nodes_offer_a_gpu_and_efa_with_the_plugin_running() -> None:
    result = readiness(efa_plugin(efa_plugin_tolerations()), gpu_node("a"), gpu_node("b"), plugin_pod("a"),
                       plugin_pod("b"))
    assert result.is_ready and result.blocker == ""
    assert result.summary == ("2 GPU nodes, each with 1 nvidia.com/gpu and 1 vpc.amazonaws.com/efa, the EFA device "
                              "plugin running on each")


def test_eksctls_own_tolerations_never_cover_the_gpu_taint_and_that_stops_up_at_once() -> None:
    result = readiness(efa_plugin(EKSCTL_TOLERATIONS), gpu_node("a", efa="0"), gpu_node("b", efa="0"))
    assert not result.is_ready
    assert "does not tolerate the taint nvidia.com/gpu=true:NoSchedule of node a" in result.blocker
    assert "patch daemonset aws-efa-k8s-device-plugin --type merge" in result.blocker


def test_a_plugin_still_starting_and_a_node_not_yet_offering_efa_are_waited_for() -> None:
    result = readiness(efa_plugin(efa_plugin_tolerations()), gpu_node("a"), gpu_node("b", efa="0"),
                       plugin_pod("a"), plugin_pod("b", phase="Pending"))
    assert not result.is_ready and result.blocker == ""
    assert result.summary == "EFA device plugin on b: Pending; b offers 0 vpc.amazonaws.com/efa of 1"
    assert readiness(gpu_node("a")).summary == "1/2 GPU nodes registered"


def test_gpu_nodes_without_an_nvidia_device_plugin_stop_up_at_once_not_after_600_s() -> None:
    nvidia = {"kind": "DaemonSet", "metadata": {"name": "nvidia-device-plugin-daemonset", "namespace": "kube-system"}}
    nodes = (efa_plugin(efa_plugin_tolerations()), gpu_node("a", gpus="0"), gpu_node("b", gpus="0"), plugin_pod("a"),
             plugin_pod("b"))
    result = readiness(*nodes)
    assert "no NVIDIA device plugin DaemonSet in kube-system, so a, b will never offer nvidia.com/gpu" in result.blocker
    assert readiness(*nodes, nvidia).blocker == ""  # the plugin is there, still starting: waited for


def test_an_instance_type_the_plugins_affinity_leaves_out_stops_up() -> None:
    result = readiness(efa_plugin(efa_plugin_tolerations()), gpu_node("a", instance_type="g6.xlarge"),
                       gpu_node("b", instance_type="g6.xlarge"))
    assert "node affinity leaves out node a (g6.xlarge)" in result.blocker


def test_the_image_must_carry_the_configured_ray() -> None:
    assert ray_version_problem("2.60.0\n", settings=settings()) == ""
    assert "has Ray 2.54.0, but kubernetes.ray_version is 2.60.0" in ray_version_problem("2.54.0", settings=settings())
    assert "printed no Ray version" in ray_version_problem("ModuleNotFoundError: ray", settings=settings())


@pytest.mark.parametrize(("status", "is_done", "blocked"), [
    ("ACTIVE", True, ""), ("CREATE_FAILED", False, "exists but is CREATE_FAILED"),
    ("DEGRADED", False, "exists but is DEGRADED"), ("CREATING", False, "is CREATING: another eksctl"),
])
def test_a_node_group_is_done_only_when_active(status: str, is_done: bool, blocked: str) -> None:
    # eksctl get nodegroup -o json prints a JSON array of summaries (pkg/actions/nodegroup/get.go)
    output = json.dumps([{"Cluster": "pdserve", "Name": "gpu", "Status": status, "Type": "managed"}], indent=4)
    state = node_group_state(output, eks=settings().eks, name="gpu")
    assert state.is_ready is is_done and blocked in state.blocker and bool(state.blocker) is bool(blocked)


def test_unreadable_eksctl_output_is_a_deploy_error() -> None:
    with pytest.raises(DeployError, match="unexpected output from eksctl get nodegroup"):
        node_group_state("CLUSTER NODEGROUP STATUS", eks=settings().eks, name="gpu")


def test_configurations_a_cluster_could_never_serve_are_refused_before_anything_runs() -> None:
    no_efa = load_settings(EKS_EXAMPLE, overrides={"eks.efa": False})
    with pytest.raises(ConfigError, match="prefill.placement.efa_devices asks for EFA but eks.efa is false"):
        cluster_config(no_efa, unresolved_zones(no_efa.eks))
    new_cluster = load_settings(EKS_EXAMPLE, overrides={"kubernetes.upgrade": "new_cluster"})
    with pytest.raises(ConfigError, match=r"eks.gpu_nodes is 2 \(needs 4\)"):
        cluster_config(new_cluster, unresolved_zones(new_cluster.eks))
    roomy = load_settings(EKS_EXAMPLE, overrides={"kubernetes.upgrade": "new_cluster", "eks.gpu_nodes": 4})
    assert cluster_config(roomy, unresolved_zones(roomy.eks))["managedNodeGroups"][1]["desiredCapacity"] == 4


# A node as the kubelet registers it and the node lifecycle controller taints it until it is Ready.
COMING_UP = ({"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"},
             {"key": "node.cloudprovider.kubernetes.io/uninitialized", "value": "true", "effect": "NoSchedule"})


def test_a_node_still_coming_up_is_waited_for_not_a_blocker() -> None:
    """not-ready:NoSchedule is not among the DaemonSet controller's tolerations, but it goes by itself."""
    result = readiness(efa_plugin(efa_plugin_tolerations()), gpu_node("a", efa="0", taints=COMING_UP, is_ready=False),
                       gpu_node("b"), plugin_pod("b"))
    assert result.blocker == "" and not result.is_ready
    assert ("a is coming up (Ready=False, tainted node.kubernetes.io/not-ready:NoSchedule, "
            "node.cloudprovider.kubernetes.io/uninitialized:NoSchedule)") in result.summary


@pytest.mark.parametrize(("taint", "host_network", "is_blocked"), [
    ({"key": "node.kubernetes.io/memory-pressure", "effect": "NoSchedule"}, False, False),
    ({"key": "node.kubernetes.io/disk-pressure", "effect": "NoSchedule"}, False, False),
    ({"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}, False, False),
    ({"key": "node.kubernetes.io/network-unavailable", "effect": "NoSchedule"}, True, False),
    ({"key": "node.kubernetes.io/network-unavailable", "effect": "NoSchedule"}, False, True),
    ({"key": "dedicated", "value": "batch", "effect": "NoExecute"}, False, True),
])
def test_the_tolerations_the_daemonset_controller_adds_to_its_pods_count(
    taint: dict[str, str], host_network: bool, is_blocked: bool,
) -> None:
    """kubernetes pkg/controller/daemon/util/daemonset_util.go AddOrUpdateDaemonPodTolerations."""
    plugin = efa_plugin(efa_plugin_tolerations(), host_network=host_network)
    result = readiness(plugin, gpu_node("a", taints=(taint,)), gpu_node("b"), plugin_pod("a"), plugin_pod("b"))
    assert bool(result.blocker) is is_blocked, result.blocker


def check_pod(**status: Any) -> str:
    return json.dumps({**image_check_pod(settings()), "status": status})


def terminated(exit_code: int, message: str) -> dict[str, Any]:
    return {"containerStatuses": [{"name": "check", "state": {"terminated": {
        "exitCode": exit_code, "reason": "Completed" if exit_code == 0 else "Error", "message": message}}}]}


def test_the_check_pod_writes_its_ray_version_where_its_status_carries_it() -> None:
    container = image_check_pod(settings())["spec"]["containers"][0]
    assert container["terminationMessagePolicy"] == "FallbackToLogsOnError"
    assert container["terminationMessagePath"] in container["command"][-1]
    ready = image_check_readiness(check_pod(phase="Succeeded", **terminated(0, "2.60.0")), settings=settings())
    assert ready.is_ready and ready.summary == "the image carries Ray 2.60.0"
    other = image_check_readiness(check_pod(phase="Succeeded", **terminated(0, "2.54.0")), settings=settings())
    assert "has Ray 2.54.0, but kubernetes.ray_version is 2.60.0" in other.blocker


def test_a_check_that_exits_non_zero_is_a_blocker_with_its_message() -> None:
    log = "Traceback (most recent call last):\nModuleNotFoundError: No module named 'ray'\n"
    failed = image_check_readiness(check_pod(phase="Failed", **terminated(1, log)), settings=settings())
    assert "exit 1 (Error)" in failed.blocker and "No module named 'ray'" in failed.blocker


@pytest.mark.parametrize("reason", ["ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull",
                                    "ImageInspectError", "RegistryUnavailable", "SignatureValidationFailed"])
def test_every_pull_failure_the_kubelet_reports_is_a_blocker_with_its_message(reason: str) -> None:
    waiting = {"containerStatuses": [{"name": "check", "state": {"waiting": {"reason": reason, "message": "why"}}}]}
    result = image_check_readiness(check_pod(phase="Pending", **waiting), settings=settings())
    assert f"cannot be pulled: {reason}: why" in result.blocker


def test_a_check_pod_still_pulling_is_waited_for() -> None:
    waiting = {"containerStatuses": [{"name": "check", "state": {"waiting": {"reason": "ContainerCreating"}}}]}
    result = image_check_readiness(check_pod(phase="Pending", **waiting), settings=settings())
    assert not result.is_ready and result.blocker == "" and result.summary == "ContainerCreating"
    assert image_check_readiness(check_pod(phase="Pending"), settings=settings()).summary == "Pending"

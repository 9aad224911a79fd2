"""The pure parts of ``pdserve cloud``: the ClusterConfig, zone choice, readiness, and the runner's wait."""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.config import Settings, load_settings, parse_settings
from pdserve.deploy.eks import plan_down, plan_up
from pdserve.deploy.eksctl import GPU_NODE_GROUP, MEMLOCK_BYTES, SYSTEM_NODE_GROUP, choose_zones, cluster_config
from pdserve.deploy.k8s import render_manifests
from pdserve.deploy.k8s_secrets import NewSecrets
from pdserve.deploy.pod_diagnosis import rayservice_readiness
from pdserve.deploy.runner import run_plan
from pdserve.deploy.steps import Poll, Step
from pdserve.errors import ConfigError, DeployError

EKS_EXAMPLE = Path(__file__).parents[2] / "examples" / "eks-g6-efa.yaml"
OFFERINGS = json.dumps({"InstanceTypeOfferings": [
    {"InstanceType": "g6.8xlarge", "Location": "us-west-2c"}, {"InstanceType": "g6.8xlarge", "Location": "us-west-2b"},
    {"InstanceType": "m7i.xlarge", "Location": "us-west-2b"}, {"InstanceType": "m7i.xlarge", "Location": "us-west-2a"},
]})


def eks_settings(**tree: Any) -> Settings:
    pools = {"device": "cuda", "gpu_ids": [0], "placement": {"node_labels": {"pdserve.io/gpu": "l4"}, "efa_devices": 1}}
    return parse_settings({"prefill": pools, "decode": pools, "gateway": {"port": 9000}, **tree}, source="test")


def node_group(config: dict[str, Any], name: str) -> dict[str, Any]:
    (group,) = [group for group in config["managedNodeGroups"] if group["name"] == name]
    return group


def rendered_node_selectors(settings: Settings) -> tuple[dict[str, str], list[dict[str, str]]]:
    """(the head's nodeSelector, each worker group's) from the RayService ``render k8s`` writes."""
    (rayservice,) = [obj for obj in render_manifests(settings) if obj["kind"] == "RayService"]
    cluster = rayservice["spec"]["rayClusterConfig"]
    head = cluster["headGroupSpec"]["template"]["spec"].get("nodeSelector", {})
    workers = [group["template"]["spec"].get("nodeSelector", {}) for group in cluster["workerGroupSpecs"]]
    return head, workers


@pytest.mark.parametrize("settings", [eks_settings(), load_settings(EKS_EXAMPLE)], ids=["labels", "eks-example"])
def test_node_groups_carry_the_labels_the_rendered_pods_select(settings: Settings) -> None:
    zones = choose_zones(OFFERINGS, settings.eks)
    config = cluster_config(settings, zones)
    system, gpu = node_group(config, SYSTEM_NODE_GROUP), node_group(config, GPU_NODE_GROUP)
    head_selector, worker_selectors = rendered_node_selectors(settings)
    # the kubelet labels every node with its instance type itself
    system_labels = system["labels"] | {"node.kubernetes.io/instance-type": system["instanceType"]}
    gpu_labels = gpu["labels"] | {"node.kubernetes.io/instance-type": gpu["instanceType"]}
    assert head_selector and head_selector.items() <= system_labels.items()
    assert len(worker_selectors) == 2
    for selector in worker_selectors:
        assert selector and selector.items() <= gpu_labels.items()


def test_the_efa_gpu_group_sits_in_one_zone_that_offers_its_instance_type() -> None:
    settings = eks_settings()
    config = cluster_config(settings, choose_zones(OFFERINGS, settings.eks))
    gpu = node_group(config, GPU_NODE_GROUP)
    assert gpu["availabilityZones"] == ["us-west-2b"]  # first sorted zone offering g6.8xlarge
    assert gpu["efaEnabled"] is True and gpu["privateNetworking"] is True
    assert gpu["taints"] == [{"key": "nvidia.com/gpu", "value": "true", "effect": "NoSchedule"}]
    assert (gpu["instanceType"], gpu["desiredCapacity"]) == ("g6.8xlarge", 2)
    # a subnet in each zone the GPU group may move to; the system group where m7i.xlarge is offered
    assert config["availabilityZones"] == ["us-west-2b", "us-west-2c"]
    assert node_group(config, SYSTEM_NODE_GROUP)["availabilityZones"] == ["us-west-2b"]


def test_configured_gpu_zones_are_tried_in_their_order_with_a_system_zone_added_where_none_offers_it() -> None:
    settings = eks_settings(eks={"availability_zones": ["us-west-2c"]})
    zones = choose_zones(OFFERINGS, settings.eks)
    assert (zones.gpu, zones.cluster, zones.system) == (("us-west-2c",), ("us-west-2c", "us-west-2a"), ("us-west-2a",))
    both = eks_settings(eks={"availability_zones": ["us-west-2c", "us-west-2b"]})
    assert choose_zones(OFFERINGS, both.eks).gpu == ("us-west-2c", "us-west-2b")
    assert node_group(cluster_config(both, choose_zones(OFFERINGS, both.eks), gpu_zone="us-west-2b"),
                      GPU_NODE_GROUP)["availabilityZones"] == ["us-west-2b"]


def test_a_configured_zone_that_lacks_the_instance_type_is_refused_naming_the_zones_that_have_it() -> None:
    settings = eks_settings(eks={"availability_zones": ["us-west-2b", "us-west-2a"]})
    with pytest.raises(DeployError, match=r"g6.8xlarge is not offered in zone us-west-2a \(offered in: us-west-2b, "
                                          r"us-west-2c\)"):
        choose_zones(OFFERINGS, settings.eks)


def test_pools_selecting_different_values_of_one_label_cannot_share_the_gpu_group() -> None:
    settings = eks_settings(decode={"placement": {"node_labels": {"pdserve.io/gpu": "h200"}}})
    with pytest.raises(ConfigError, match="pdserve.io/gpu"):
        cluster_config(settings, choose_zones(OFFERINGS, settings.eks))


SECRETS = NewSecrets(ray_token="tok-" + "r" * 40, engine_key="eng-" + "e" * 40, api_key="api-" + "a" * 40,
                     admin_key="adm-" + "d" * 40)


def test_the_plans_never_carry_a_key_outside_its_secret_steps_stdin() -> None:
    settings = eks_settings()
    steps = plan_up(settings, zones=choose_zones(OFFERINGS, settings.eks), secrets=SECRETS)
    for step_name, keys in (("ray-token", [SECRETS.ray_token]), ("engine-key", [SECRETS.engine_key]),
                            ("api-keys", [SECRETS.api_key, SECRETS.admin_key])):
        for key in keys:
            carrying = [step for step in steps if key in step.stdin]
            assert [(step.name, step.is_stdin_secret) for step in carrying] == [(step_name, True)]
            assert not any(key in shlex.join(argv) for step in steps for argv in (step.argv, step.done_check,
                                                                                   step.only_if))


def test_up_makes_each_required_secret_before_the_manifests_and_only_where_it_is_missing() -> None:
    """The pods require the three Secrets (no `optional`): they must exist before the RayService is applied."""
    settings = eks_settings()
    steps = plan_up(settings, zones=choose_zones(OFFERINGS, settings.eks), secrets=SECRETS)
    names = [step.name for step in steps]
    made = {step.name: step for step in steps if step.argv[3:5] == ("create", "secret")}
    assert list(made) == ["ray-token", "engine-key", "api-keys"]
    assert names.index("namespace") < min(names.index(name) for name in made) < names.index("manifests")
    for step in made.values():
        secret = step.argv[6]
        assert step.done_check[3:] == ("get", "secret", secret, "--namespace", "pdserve")
    assert made["api-keys"].argv[-1] == "--from-env-file=/dev/stdin"
    # KEY=VALUE lines, as kubectl's --from-env-file reads them (create_secret.go, handleSecretFromEnvFileSources)
    assert made["api-keys"].stdin == f"api_keys={SECRETS.api_key}\nadmin_key={SECRETS.admin_key}\n"
    assert made["engine-key"].argv[-1] == "--from-file=engine_key=/dev/stdin"
    opened = plan_up(eks_settings(access={"open": True}), zones=choose_zones(OFFERINGS, settings.eks), secrets=SECRETS)
    assert "api-keys" not in [step.name for step in opened]


def test_generated_keys_are_new_each_time_and_keys_the_gateway_accepts() -> None:
    first, second = NewSecrets.generate(), NewSecrets.generate()
    values = [first.ray_token, first.engine_key, first.api_key, first.admin_key, second.api_key]
    assert len(set(values)) == len(values)
    for key in values:  # what access.py and engine_key.py accept: visible ASCII, 16 characters at least
        assert re.fullmatch(r"[\x21-\x7e]{16,}", key)
    assert first.api_key not in repr(first)  # never in a traceback or a log


def test_the_cluster_turns_on_the_vpc_cnis_network_policy_enforcement() -> None:
    """Without enableNetworkPolicy the VPC CNI accepts NetworkPolicies and enforces none."""
    settings = eks_settings()
    config = cluster_config(settings, choose_zones(OFFERINGS, settings.eks))
    (vpc_cni,) = [addon for addon in config["addons"] if addon["name"] == "vpc-cni"]
    assert json.loads(vpc_cni["configurationValues"]) == {"enableNetworkPolicy": "true"}  # a string in its schema
    assert vpc_cni["resolveConflicts"] == "overwrite"


def test_every_step_of_up_and_down_is_safe_to_rerun() -> None:
    """A create is skipped once done; a removal runs only while there is something to remove."""
    settings = eks_settings()
    up = plan_up(settings, zones=choose_zones(OFFERINGS, settings.eks), secrets=SECRETS)
    creates = [step for step in up if "create" in step.argv and step.name != "image-check-pod"]
    assert {step.name for step in creates} == {"cluster", "system-nodes", "gpu-nodes", "ray-token", "engine-key",
                                               "api-keys"}
    assert all(step.done_check for step in creates)
    # the image check's pod is made anew on every run, right after the pod an interrupted run left is removed
    names = [step.name for step in up]
    assert names[names.index("image-check-pod") - 1] == "image-check-clean"
    assert all(step.only_if for step in plan_down(settings))


def test_the_eksctl_config_is_valid_yaml_for_every_node_group_step() -> None:
    settings = eks_settings()
    steps = plan_up(settings, zones=choose_zones(OFFERINGS, settings.eks), secrets=SECRETS)
    configs = {step.name: yaml.safe_load(step.stdin) for step in steps if step.argv[0] == "eksctl" and step.stdin}
    assert list(configs) == ["cluster", "system-nodes", "gpu-nodes"]
    assert all(config == configs["cluster"] for config in configs.values())


def test_rayservice_readiness_names_each_deployment_until_ready() -> None:
    deploying = {"status": {"pendingServiceStatus": {"applicationStatuses": {"pdserve": {
        "status": "DEPLOYING", "serveDeploymentStatuses": {"prefill": {"status": "UPDATING"}}}}}}}
    readiness = rayservice_readiness(json.dumps(deploying))
    assert not readiness.is_ready and readiness.summary == "app pdserve DEPLOYING (prefill UPDATING)"
    assert rayservice_readiness(json.dumps({"status": {"conditions": [{"type": "Ready", "status": "True"}]}})).is_ready
    assert rayservice_readiness(json.dumps({"status": {"serviceStatus": "Running"}})).is_ready  # KubeRay < 1.3
    assert rayservice_readiness(json.dumps({})).summary == "no Serve application status yet"


def test_the_wait_prints_progress_until_ready_and_gives_up_at_its_timeout(tmp_path: Path) -> None:
    counter = tmp_path / "looks"
    # not ready on the first two looks, ready on the third
    script = (f"import json, pathlib; p = pathlib.Path({str(counter)!r}); n = int(p.read_text() or 0) "
              f"if p.exists() else 0; p.write_text(str(n + 1)); print(json.dumps({{'status': "
              f"{{'serviceStatus': 'Running' if n >= 2 else 'WaitForServeDeploymentReady'}}}}))")
    look = (sys.executable, "-c", script)
    lines: list[str] = []
    run_plan([Step("serving", look, poll=Poll(check=rayservice_readiness, timeout_s=30, interval_s=0.01))],
             progress=lines.append)
    assert [line.split()[2] for line in lines] == ["running:", "waiting", "waiting", "ready:", "done"]

    never = (sys.executable, "-c", "print('{}')")
    with pytest.raises(DeployError, match=r"step serving: not ready after 0s \(no Serve application status yet\)"):
        run_plan([Step("serving", never, poll=Poll(check=rayservice_readiness, timeout_s=0.05, interval_s=0.01))],
                 progress=lines.append)


def test_the_gpu_nodes_lift_memlock_for_every_container_through_nodeadms_base_runtime_spec() -> None:
    """The AL2023 AMI's base runtime spec sets only RLIMIT_NOFILE; NIXL must pin GiBs as uid 1000."""
    settings = eks_settings()
    config = cluster_config(settings, choose_zones(OFFERINGS, settings.eks))
    gpu, system = node_group(config, GPU_NODE_GROUP), node_group(config, SYSTEM_NODE_GROUP)
    node_config = yaml.safe_load(gpu["overrideBootstrapCommand"])
    assert (gpu["amiFamily"], node_config["apiVersion"], node_config["kind"]) == (
        "AmazonLinux2023", "node.eks.aws/v1alpha1", "NodeConfig")
    rlimits = {limit["type"]: limit for limit in node_config["spec"]["containerd"]["baseRuntimeSpec"]["process"]["rlimits"]}
    assert rlimits["RLIMIT_MEMLOCK"]["soft"] == rlimits["RLIMIT_MEMLOCK"]["hard"] == MEMLOCK_BYTES
    assert float(MEMLOCK_BYTES) == MEMLOCK_BYTES < 2**63  # nodeadm's float64 keeps it; signed, it stays positive
    assert rlimits["RLIMIT_NOFILE"] == {"type": "RLIMIT_NOFILE", "soft": 65536, "hard": 1048576}  # the AMI's own
    assert "overrideBootstrapCommand" not in system


def test_the_cluster_runs_kubernetes_1_35_by_default() -> None:
    """eksctl's own default, 1.34, is at the end of its standard support; eksctl knows 1.35 (Version1_35)."""
    settings = eks_settings()
    assert cluster_config(settings, choose_zones(OFFERINGS, settings.eks))["metadata"]["version"] == "1.35"

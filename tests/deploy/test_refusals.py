"""`pdserve config validate` refuses what `render k8s` and `cloud up` would refuse from the file alone, all at once."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from pdserve.config import Settings, parse_settings
from pdserve.deploy.eks import plan_up
from pdserve.deploy.eksctl import unresolved_zones
from pdserve.deploy.k8s import render_manifests
from pdserve.deploy.k8s_secrets import NewSecrets
from pdserve.deploy.refusals import cluster_refusals
from pdserve.errors import ConfigError

REPO = Path(__file__).parents[2]
GPU_POOL = {"device": "cuda", "gpu_ids": [0]}
EFA_POOL = {**GPU_POOL, "placement": {"efa_devices": 1}}
# An EKS configuration render and cloud up accept; each case below changes one thing.
EKS_TREE: dict[str, Any] = {"gateway": {"port": 9000}, "prefill": EFA_POOL, "decode": EFA_POOL,
                            "kubernetes": {"image": "pdserve:1"}, "eks": {"region": "us-west-2"}}
DECODE_ONLY_EFA = {**EKS_TREE, "prefill": GPU_POOL}


def settings(tree: dict[str, Any]) -> Settings:
    return parse_settings(tree, source="test")


def render_refusal(tree: dict[str, Any]) -> str:
    """The message `render k8s` stops with."""
    with pytest.raises(ConfigError) as refusal:
        render_manifests(settings(tree))
    return str(refusal.value)


def cloud_up_refusal(tree: dict[str, Any]) -> str:
    """The message `cloud up` (its plan, as --dry-run builds it) stops with."""
    config = settings(tree)
    with pytest.raises(ConfigError) as refusal:
        plan_up(config, zones=unresolved_zones(config.eks), secrets=NewSecrets.generate())
    return str(refusal.value)


def pdserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pdserve", *args], capture_output=True, text=True, timeout=60,
                          cwd=REPO, check=False)


def test_decode_only_efa_exits_2_from_validate_with_the_message_render_k8s_gives(tmp_path: Path) -> None:
    path = tmp_path / "decode-efa.yaml"
    path.write_text(yaml.safe_dump(DECODE_ONLY_EFA))
    validate, render = pdserve("config", "validate", str(path)), pdserve("render", "k8s", "--config", str(path))
    assert (validate.returncode, render.returncode) == (2, 2)
    assert "EFA is on the decode pool only" in render.stderr
    assert validate.stderr == render.stderr and validate.stdout == ""


def with_changes(tree: dict[str, Any], **sections: dict[str, Any]) -> dict[str, Any]:
    return {**tree, **{name: {**tree.get(name, {}), **changes} for name, changes in sections.items()}}


RENDER_REFUSES = {  # refused by `render k8s` and so by `cloud up`
    "gateway on Ray's serve port": (with_changes(EKS_TREE, gateway={"port": 8000}), "Ray's serve port"),
    "two gateways behind KubeRay's head Service": (
        with_changes(EKS_TREE, gateway={"replicas": 2}, kubernetes={"upgrade": "new_cluster"},
                     eks={"gpu_nodes": 4}), "gateway.replicas > 1 needs kubernetes.upgrade: recreate"),
    "EFA on the decode pool only": (DECODE_ONLY_EFA, "EFA is on the decode pool only"),
}
CLOUD_UP_REFUSES = {  # render k8s has no node groups: only `cloud up` refuses these
    "EFA asked of a node group without it": (with_changes(EKS_TREE, eks={"efa": False}), "eks.efa is false"),
    "no room for KubeRay's NewCluster upgrade": (
        with_changes(EKS_TREE, kubernetes={"upgrade": "new_cluster"}), "eks.gpu_nodes is 2 (needs 4)"),
    "pools wanting two values of one node label": (
        {**EKS_TREE, "prefill": {**GPU_POOL, "placement": {"efa_devices": 1, "node_labels": {"gpu": "l4"}}},
         "decode": {**GPU_POOL, "placement": {"efa_devices": 1, "node_labels": {"gpu": "a10g"}}}},
        "set gpu to 'l4' and 'a10g'"),
    "a pool selecting another GPU instance type": (
        {**EKS_TREE, "decode": {**GPU_POOL, "placement": {
            "efa_devices": 1, "node_labels": {"node.kubernetes.io/instance-type": "g5.8xlarge"}}}},
        "placement.node_labels: selects node.kubernetes.io/instance-type=g5.8xlarge"),
    "the head selecting another system instance type": (
        with_changes(EKS_TREE, kubernetes={"head_node_labels": {"node.kubernetes.io/instance-type": "m5.large"}}),
        "kubernetes.head_node_labels: selects node.kubernetes.io/instance-type=m5.large"),
}


@pytest.mark.parametrize(("tree", "words"), RENDER_REFUSES.values(), ids=RENDER_REFUSES.keys())
def test_validate_refuses_what_render_k8s_refuses_with_its_message(tree: dict[str, Any], words: str) -> None:
    refusal = render_refusal(tree)
    assert words in refusal
    assert cluster_refusals(settings(tree)) == [refusal]


@pytest.mark.parametrize(("tree", "words"), CLOUD_UP_REFUSES.values(), ids=CLOUD_UP_REFUSES.keys())
def test_validate_refuses_what_cloud_up_refuses_with_its_message(tree: dict[str, Any], words: str) -> None:
    render_manifests(settings(tree))
    refusal = cloud_up_refusal(tree)
    assert words in refusal
    assert cluster_refusals(settings(tree)) == [refusal]


def test_every_refusal_is_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "three.yaml"
    path.write_text(yaml.safe_dump(with_changes(DECODE_ONLY_EFA, gateway={"port": 8000}, eks={"efa": False})))
    result = pdserve("config", "validate", str(path))
    assert result.returncode == 2
    lines = result.stderr.removeprefix("error: ").splitlines()
    assert [line.split(": ")[0] for line in lines] == [
        "gateway.port", "decode.placement.efa_devices", "decode.placement.efa_devices asks for EFA but eks.efa is false"]


def test_a_file_for_one_machine_or_ray_is_not_held_to_a_clusters_rules() -> None:
    """The defaults put the gateway on 8000, Ray's serve port on a head: fine outside Kubernetes."""
    assert cluster_refusals(settings({})) == []
    assert cluster_refusals(settings({"ray": {"gateway_cpus": 1}, "decode": EFA_POOL})) == []
    assert cluster_refusals(settings({"kubernetes": {"image": "pdserve:1"}})) == [render_refusal({})]
    own_cluster = {name: section for name, section in with_changes(EKS_TREE, kubernetes={"upgrade": "new_cluster"})
                   .items() if name != "eks"}  # render k8s for a cluster of one's own: no node groups to fit
    assert cluster_refusals(settings(own_cluster)) == []
    assert cluster_refusals(settings(EKS_TREE)) == []

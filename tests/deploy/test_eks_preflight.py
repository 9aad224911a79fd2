"""``cloud up``'s preflight, before anything is created, and the GPU node group's move to the next zone when
EC2 has no capacity: through the real code path, against the stand-in tools (eks_standins.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from pdserve.deploy.aws_preflight import preflight_steps
from pdserve.deploy.runner import run_plan
from pdserve.deploy.steps import Fallback, Step
from pdserve.errors import DeployError
from tests.deploy.test_eks import CONFIG, Standins, cloud, standins, step_lines, stopped_up
from tests.deploy.test_eks_plan import EKS_EXAMPLE, eks_settings

__all__ = ["standins"]  # test_eks.py's fixture, used here by name

ECR_IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/pdserve:0.1.0"


VERSION_COMMANDS = ["eksctl version", "kubectl version --client --output json", "helm version --short"]


def changes(standins: Standins) -> list[str]:
    """The commands but the tools' version checks."""
    return [command for command in standins.commands() if command not in VERSION_COMMANDS]


def created_anything(standins: Standins) -> bool:
    return any(command.startswith(("eksctl create", "kubectl", "helm")) for command in changes(standins))


def with_image(standins: Standins, image: str) -> None:
    standins.config.write_text(CONFIG.replace("namespace: serving}", f"namespace: serving, image: '{image}'}}"))


def test_up_dry_run_of_the_example_shows_the_quota_zone_and_image_checks_before_the_cluster(
    standins: Standins,
) -> None:
    result = cloud(standins, "up", "--dry-run")  # the stand-in config, then the example itself
    assert result.exit_code == 0, result.output
    standins.config.write_text(EKS_EXAMPLE.read_text())
    result = cloud(standins, "up", "--dry-run")
    assert result.exit_code == 0, result.output
    steps = list(step_lines(result.output))
    assert steps[:12] == ["eksctl-version", "kubectl-version", "helm-version", "aws-identity", "instance-types",
                          "quota-L-DB2E81BA", "quota-L-DB2E81BA-default", "quota-L-1216C47A",
                          "quota-L-1216C47A-default", "zones", "image", "cluster-stack"]
    assert ("aws service-quotas get-service-quota --service-code ec2 --quota-code L-DB2E81BA --region us-west-2"
            in result.output)
    assert "covers 2 x g6.8xlarge" in result.output
    assert "aws ecr describe-images --registry-id '<account>' --repository-name pdserve --image-ids imageTag=0.1.0" \
        in result.output
    # the placeholder: said where `up` would stop, and the whole plan still shown
    assert result.output.startswith("warning: `up` without --dry-run would stop here, before its first check")
    assert "<account> is a placeholder" in result.output and "] serving" in result.output
    assert "InsufficientInstanceCapacity" in result.output and "cluster placement group" in result.output
    assert standins.calls() == []


def test_a_placeholder_in_the_image_is_refused_before_any_tool_runs(standins: Standins) -> None:
    with_image(standins, "<account>.dkr.ecr.us-west-2.amazonaws.com/pdserve:0.1.0")
    result = stopped_up(standins)
    assert "nothing was created: kubernetes.image is <account>.dkr.ecr" in result.stderr
    assert "<account> is a placeholder" in result.stderr
    assert standins.calls() == []


def test_missing_credentials_stop_up_at_the_first_check_with_how_to_give_them(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_AWS_CREDENTIALS", "none")
    result = stopped_up(standins)
    assert "step aws-identity failed (exit 253): aws sts get-caller-identity" in result.stderr
    assert "Unable to locate credentials" in result.stderr and "`aws configure`" in result.stderr
    assert changes(standins) == ["aws sts get-caller-identity --region us-west-2 --output json"]


def test_a_region_that_does_not_exist_stops_up_at_the_first_check(standins: Standins) -> None:
    standins.config.write_text(CONFIG.replace("region: us-west-2", "region: us-wst-2"))
    result = stopped_up(standins)
    assert "step aws-identity failed (exit 255)" in result.stderr
    assert 'Could not connect to the endpoint URL: "https://sts.us-wst-2.amazonaws.com/"' in result.stderr
    assert "set eks.region to a region the account has enabled" in result.stderr
    assert not created_anything(standins)


def test_a_gpu_quota_below_the_nodes_vcpus_stops_up_before_the_cluster_with_the_request_to_make(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_QUOTAS", "L-DB2E81BA=32")
    result = stopped_up(standins)
    assert ("the quota 'Running On-Demand G and VT instances' (L-DB2E81BA) in us-west-2 is 32 vCPUs, but 2 x "
            "g6.8xlarge (32 vCPUs each) need 64") in result.stderr
    assert ("aws service-quotas request-service-quota-increase --service-code ec2 --quota-code L-DB2E81BA "
            "--desired-value 64 --region us-west-2") in result.stderr
    assert not created_anything(standins)
    assert not any("describe-instance-type-offerings" in command for command in standins.commands())


@pytest.mark.parametrize(("pushed", "error"), [
    ("pdserve:0.0.9", "ImageNotFoundException"), ("other:0.1.0", "RepositoryNotFoundException")])
def test_an_ecr_image_that_is_not_there_stops_up_before_the_cluster_with_the_push_to_make(
    standins: Standins, monkeypatch: pytest.MonkeyPatch, pushed: str, error: str,
) -> None:
    with_image(standins, ECR_IMAGE)
    monkeypatch.setenv("STANDIN_ECR_IMAGES", pushed)
    result = stopped_up(standins)
    assert "step image failed (exit 254): aws ecr describe-images --registry-id 123456789012" in result.stderr
    assert f"An error occurred ({error}) when calling the DescribeImages operation" in result.stderr
    assert f"docker push {ECR_IMAGE}" in result.stderr
    assert not created_anything(standins)

    monkeypatch.setenv("STANDIN_ECR_IMAGES", "pdserve:0.1.0")
    standins.forget_calls()
    assert cloud(standins, "up").exit_code == 0


def test_no_gpu_capacity_in_the_first_zone_moves_the_gpu_node_group_to_the_next_and_says_so(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_NO_CAPACITY", "us-west-2b")
    result = cloud(standins, "up")
    assert result.exit_code == 0, result.output
    gpu_lines = "\n".join(step_lines(result.output)["gpu-nodes"])
    assert "zone us-west-2b: EC2 has no g6.8xlarge to spare in that zone (InsufficientInstanceCapacity)" in gpu_lines
    assert "trying zone us-west-2d instead" in gpu_lines
    groups = [command for command in standins.commands() if "nodegroup" in command and "--include gpu" in command
              or command.startswith("eksctl delete nodegroup")]
    assert groups == ["eksctl create nodegroup -f - --include gpu",
                      "eksctl delete nodegroup --cluster demo --region us-west-2 --name gpu --wait",
                      "eksctl create nodegroup -f - --include gpu"]
    creates = [yaml.safe_load(call["stdin"]) for call in standins.calls() if call["words"][-1:] == ["gpu"]]
    zones = [group["availabilityZones"] for config in creates for group in config["managedNodeGroups"]
             if group["name"] == "gpu"]
    assert zones == [["us-west-2b"], ["us-west-2d"]]
    assert creates[1]["availabilityZones"] == ["us-west-2b", "us-west-2d"]  # the subnets the cluster was made with
    assert "ready: 2 GPU nodes" in result.output


def test_no_gpu_capacity_in_any_zone_stops_up_naming_each_zone_and_leaves_no_failed_group(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_NO_CAPACITY", "us-west-2b,us-west-2d")
    result = stopped_up(standins)
    assert "step gpu-nodes failed in every place it may use, for InsufficientInstanceCapacity" in result.stderr
    for zone in ("us-west-2b", "us-west-2d"):
        assert f"zone {zone}: EC2 has no g6.8xlarge to spare in that zone" in result.stderr
    assert "cluster placement group" in result.stderr and "eks.availability_zones" in result.stderr
    assert not any(command.startswith(("kubectl", "helm")) for command in changes(standins))

    monkeypatch.delenv("STANDIN_NO_CAPACITY")  # capacity came back: a re-run makes the group
    standins.forget_calls()
    rerun = cloud(standins, "up")
    assert rerun.exit_code == 0, rerun.output
    assert step_lines(rerun.output)["system-nodes"] == ["skipped (already done)"]


def test_a_failure_of_another_kind_is_not_retried_elsewhere_nor_undone(tmp_path: Path) -> None:
    undo_marker = tmp_path / "undone"
    fallback = Fallback(tries=(("zone a", ""), ("zone b", "")), explain=((sys.executable, "-c", "print('quota')"),),
                        cause=lambda output: "no capacity" if "InsufficientInstanceCapacity" in output else "",
                        undo=(sys.executable, "-c", f"open({str(undo_marker)!r}, 'w')"), about="capacity", fix="")
    failing = (sys.executable, "-c", "import sys; sys.exit('VcpuLimitExceeded')")
    lines: list[str] = []
    with pytest.raises(DeployError, match=r"step gpu-nodes \(zone a\) failed \(exit 1\)"):
        run_plan([Step("gpu-nodes", failing, fallback=fallback)], progress=lines.append)
    assert not undo_marker.exists()
    assert not any("trying" in line for line in lines)


@pytest.mark.parametrize(("default_vcpus", "is_refused"), [(32.0, True), (64.0, False)])
def test_a_quota_never_applied_to_the_account_is_checked_at_aws_default_not_called_a_missing_permission(
    standins: Standins, monkeypatch: pytest.MonkeyPatch, default_vcpus: float, is_refused: bool,
) -> None:
    """GetServiceQuota answers NoSuchResourceException for a quota the account has no value of its own for."""
    monkeypatch.setenv("STANDIN_QUOTAS_UNSET", "L-DB2E81BA")
    monkeypatch.setenv("STANDIN_QUOTAS", f"L-DB2E81BA={default_vcpus}")
    monkeypatch.setenv("STANDIN_FAIL", "eksctl create cluster")  # stop right after the preflight
    result = stopped_up(standins)
    assert "servicequotas:GetServiceQuota" not in result.stderr
    refusal = "(L-DB2E81BA) in us-west-2 is 32 vCPUs, but 2 x g6.8xlarge (32 vCPUs each) need 64"
    assert (refusal in result.stderr) is is_refused
    assert step_lines(result.output)["quota-L-DB2E81BA"] == ["skipped (nothing to do)"]


def test_each_instance_family_is_checked_against_its_own_vcpu_quota() -> None:
    def quota_steps(gpu_type: str) -> list[str]:
        steps = preflight_steps(eks_settings(eks={"gpu_instance_type": gpu_type}))
        return [step.name for step in steps if step.name.startswith("quota-") and not step.name.endswith("-default")]

    assert quota_steps("g6.8xlarge") == ["quota-L-DB2E81BA", "quota-L-1216C47A"]
    assert quota_steps("p5.48xlarge") == ["quota-L-417A185B", "quota-L-1216C47A"]
    assert quota_steps("m7i.8xlarge") == ["quota-L-1216C47A"]  # one quota, both groups counted
    assert quota_steps("inf2.xlarge") == ["quota-L-1216C47A"]  # a family with a quota pdserve does not know
    assert quota_steps("gr6.4xlarge") == ["quota-L-DB2E81BA", "quota-L-1216C47A"]  # a G instance
    for kind in ("im4gn.large", "is4gen.large"):  # I instances: their nodes count against the Standard quota
        (step,) = [step for step in preflight_steps(eks_settings(eks={"gpu_instance_type": kind}))
                   if step.name.startswith("quota-") and step.check_outputs]
        assert step.name == "quota-L-1216C47A-default" and f"covers 2 x {kind}, 1 x m7i.xlarge" in step.about

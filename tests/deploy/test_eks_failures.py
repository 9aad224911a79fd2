"""``cloud up`` and ``cloud down`` when eksctl fails: the cause reaches the user with what to do, a re-run resumes
over the stacks a failed create left, and no failure leaves the bill running unsaid (stand-ins: eks_standins.py,
cfn_standin.py)."""

from __future__ import annotations

import json

import pytest

from pdserve.deploy import eksctl
from tests.deploy.test_eks import STACKS, Standins, cloud, standins, step_lines, stopped_up

__all__ = ["standins"]  # the fixture, used by name
DOWN = "pdserve cloud down --config "
# 0.10 control plane + 0.045 NAT + m7i.xlarge 0.2016 with 80 GiB gp3 + 2 x (g6.8xlarge 2.0144 with 200 GiB gp3)
PLAN_TOTAL = "total: about $4.43/h"


def test_an_eip_create_failed_line_on_eksctls_stdout_reaches_the_user_with_what_to_do(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_CLUSTER_FAILS", "eip")
    result = stopped_up(standins)
    assert "AWS::EC2::EIP/NATIP: CREATE_FAILED" in result.stderr
    assert "The maximum number of addresses has been reached" in result.stderr
    assert "cause: Elastic IP quota: release unused addresses" in result.stderr and "L-0263D0A3" in result.stderr
    assert "still running" not in result.stderr  # the stack rolled back: nothing bills


@pytest.mark.parametrize(("variable", "reason", "cause"), [
    ("STANDIN_CLUSTER_FAILS", "iam", "cause: missing IAM permission: give the AWS identity the permission"),
    ("STANDIN_CLUSTER_FAILS", "zone", "cause: zone EKS does not support: list other zones"),
    ("STANDIN_NODEGROUP_FAILS", "gpu:vcpu", "cause: vCPU quota: ask for a higher On-Demand vCPU quota"),
])
def test_each_known_cause_gets_one_line_saying_what_to_do(
    standins: Standins, monkeypatch: pytest.MonkeyPatch, variable: str, reason: str, cause: str,
) -> None:
    monkeypatch.setenv(variable, reason)
    result = stopped_up(standins)
    assert result.stderr.count("\ncause: ") == 1 and cause in result.stderr


def test_a_rerun_after_a_rolled_back_cluster_stack_removes_it_saying_so_and_resumes(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_CLUSTER_FAILS", "eip")
    stopped_up(standins)
    monkeypatch.delenv("STANDIN_CLUSTER_FAILS")  # the quota was raised
    standins.forget_calls()
    result = cloud(standins, "up")
    assert result.exit_code == 0, result.output
    assert ("stack eksctl-demo-cluster is ROLLBACK_COMPLETE (a create that failed; eksctl would trip over it): removing "
            "it first with `eksctl delete cluster --name demo --region us-west-2 --wait`") in result.output
    eksctl_calls = [command for command in standins.commands()
                    if command.startswith(("eksctl delete cluster", "eksctl create cluster"))]
    assert [" ".join(command.split()[:3]) for command in eksctl_calls] == ["eksctl delete cluster", "eksctl create cluster"]


def test_a_failed_node_group_leaves_a_rolled_back_stack_that_the_rerun_removes_before_creating_the_group(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_NODEGROUP_FAILS", "gpu:iam")
    failed = stopped_up(standins)
    assert "AWS::IAM::Role/ServiceRole: CREATE_FAILED" in failed.stderr and "cause: missing IAM permission" in failed.stderr
    monkeypatch.delenv("STANDIN_NODEGROUP_FAILS")
    standins.forget_calls()
    rerun = cloud(standins, "up")
    assert rerun.exit_code == 0, rerun.output
    assert ("stack eksctl-demo-nodegroup-gpu is ROLLBACK_COMPLETE (a create that failed; eksctl would trip over it): "
            "removing it first with `eksctl delete nodegroup --cluster demo --region us-west-2 --name gpu --wait`"
            in rerun.output)
    assert step_lines(rerun.output)["system-nodes"] == ["skipped (already done)"]
    assert "ready: 2 GPU nodes" in rerun.output


def test_create_nodegroup_exiting_0_over_an_existing_stack_stops_up_naming_the_stack_and_its_removal(
    standins: Standins,
) -> None:
    """The group was deleted outside CloudFormation, its stack stays: eksctl leaves the group out and exits 0."""
    assert cloud(standins, "up").exit_code == 0
    state_path = standins.log.with_name("state.json")
    state = json.loads(state_path.read_text())
    del state["nodegroups"]["gpu"]
    state_path.write_text(json.dumps(state))
    standins.forget_calls()
    result = stopped_up(standins)
    assert ("step gpu-nodes: eksctl created nothing: 2026-12-08 00:00:00 [ℹ]  1 existing nodegroup(s) (gpu) will be "
            "excluded (its stack eksctl-demo-nodegroup-gpu exists). Remove it with `eksctl delete nodegroup --cluster "
            "demo --region us-west-2 --name gpu --wait`") in result.stderr
    assert standins.polls("get nodes,daemonsets,pods") == 0, "no 600 s wait for nodes that never come"


def test_a_failure_at_serving_says_what_still_bills_per_hour_and_the_command_that_removes_it(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(eksctl, "MEMLOCK_BYTES", 2**63 - 1)  # the engines fail their preflight
    result = stopped_up(standins)
    tail = result.stderr.split("still running, billed by the hour:")[1]
    assert "EKS control plane demo: $0.10/h" in tail and "NAT gateway of the cluster's VPC: $0.04/h" in tail
    assert "1 x m7i.xlarge (node group system, 80 GiB gp3 each): $0.21/h" in tail
    assert "2 x g6.8xlarge (node group gpu, 200 GiB gp3 each): $4.07/h" in tail
    assert PLAN_TOTAL in tail and f"remove it with: {DOWN}{standins.config}" in tail


def test_up_dry_run_shows_the_version_floors_and_the_plans_cost_per_hour(standins: Standins) -> None:
    result = cloud(standins, "up", "--dry-run")
    assert result.exit_code == 0, result.output
    for floor in ("preflight: eksctl 0.205.0 or newer (baseRuntimeSpec)",
                  "preflight: kubectl 1.34.0 or newer (one minor version from Kubernetes 1.35)",
                  "preflight: helm 3.10.0 or newer (--set-json)"):
        assert floor in result.output
    assert "while it runs, the plan costs per hour:" in result.output and PLAN_TOTAL in result.output
    assert f"`{DOWN}{standins.config}` removes it" in result.output
    assert standins.calls() == []


@pytest.mark.parametrize(("variable", "version", "words"), [
    ("STANDIN_EKSCTL_VERSION", "0.204.0", "eksctl is 0.204.0, older than 0.205.0"),
    ("STANDIN_KUBECTL_VERSION", "1.32.3", "kubectl is 1.32.3, older than 1.34.0"),
    ("STANDIN_HELM_VERSION", "3.9.4", "helm is 3.9.4, older than 3.10.0"),
])
def test_a_tool_older_than_its_floor_stops_up_before_any_aws_call(
    standins: Standins, monkeypatch: pytest.MonkeyPatch, variable: str, version: str, words: str,
) -> None:
    monkeypatch.setenv(variable, version)
    result = stopped_up(standins)
    assert words in result.stderr
    assert not [command for command in standins.commands() if command.startswith("aws")]


def test_a_version_that_cannot_be_read_names_the_tool() -> None:
    from pdserve.deploy.tool_versions import version_problem  # here: the module is new, the others run without it

    problem = version_problem("dev", tool="eksctl", floor=(0, 205, 0), source="https://eksctl.io/installation/")
    assert problem.startswith("eksctl printed no version ('dev')")


def test_a_vpc_left_delete_failed_is_not_called_removed_and_a_second_down_tries_again(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert cloud(standins, "up").exit_code == 0
    monkeypatch.setenv("STANDIN_VPC_DELETE_FAILS", "1")
    for _ in range(2):
        standins.forget_calls()
        down = cloud(standins, "down")
        assert down.exit_code == 1, down.output
        assert "AWS::EC2::VPC/VPC: DELETE_FAILED" in down.stderr and "has dependencies" in down.stderr
        assert "NAT gateway of the cluster's VPC" in down.stderr and f"{DOWN}{standins.config}" in down.stderr
        assert "removed" not in down.output
        assert any(command.startswith("eksctl delete cluster") for command in standins.commands())
    monkeypatch.delenv("STANDIN_VPC_DELETE_FAILS")  # the load balancer's ENIs were removed
    standins.forget_calls()
    last = cloud(standins, "down")
    assert last.exit_code == 0, last.output
    assert "no stack of it is listed any more; removed this run: cluster" in last.output
    assert standins.commands()[-1].startswith(STACKS)


def test_a_transient_pull_error_is_waited_out_not_taken_for_a_missing_image(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_IMAGE_PULL", "transient")
    result = cloud(standins, "up")
    assert result.exit_code == 0, result.output
    waits = [line for line in step_lines(result.output)["image-ray-version"] if line.startswith("waiting")]
    assert any("ErrImagePull" in line and "connection reset by peer" in line for line in waits), waits
    assert "ready: the image carries Ray 2.60.0" in result.output

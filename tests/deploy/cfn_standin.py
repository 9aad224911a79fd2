"""eksctl's CloudFormation stacks for eks_standins.py: what ``create cluster``, ``create nodegroup`` and ``delete
cluster`` leave behind, how they fail, and ``aws cloudformation describe-stacks``; and the tools' versions.

Each behaviour cites its source:
- eksctl writes every log line to stdout (kris-nova/logger's Writer is os.Stdout: eksctl cmd/eksctl/logger.go:46-54);
  only cobra's "Error: ..." for the returned error goes to stderr (cmd/eksctl/main.go:104-113, cobra prints it).
- A stack eksctl creates rolls back on failure (DisableRollback false by default: pkg/cfn/manager/api.go:121-125)
  and stays, ROLLBACK_COMPLETE. While it waits, eksctl prints each CREATE_FAILED resource with its reason
  (pkg/cfn/manager/waiters.go:26-44, "%s/%s: %s – %#v"), then for a cluster the lines of
  pkg/ctl/create/cluster.go:384-394.
- ``create cluster`` over a stack of that name fails: CloudFormation's CreateStack refuses an existing name
  (AlreadyExistsException, "Stack [NAME] already exists").
- ``create nodegroup`` lists the cluster's stacks in every status but DELETE_COMPLETE/DELETE_FAILED
  (pkg/cfn/manager/nodegroup.go:239-259, api.go:552-574) and leaves out every group that has one, saying
  "N existing nodegroup(s) (NAMES) will be excluded" (pkg/ctl/cmdutils/filter/nodegroup_filter.go:80-91); with
  nothing left to create it exits 0 (pkg/actions/nodegroup/create.go:158-198).
- ``delete cluster --wait`` removes the node group stacks, the EKS cluster, then the cluster stack; when that
  stack's VPC cannot be deleted (a load balancer's ENIs left in it) the stack is DELETE_FAILED, eksctl prints the
  DELETE_FAILED resources (waiters.go:50-53) and fails.
- ``eksctl version`` prints the bare version (pkg/version/version.go:49-51); ``kubectl version --client -o json``
  puts it in clientVersion.gitVersion; ``helm version --short`` prints "vX.Y.Z+gCOMMIT".
STANDIN_CLUSTER_FAILS=<reason> and STANDIN_NODEGROUP_FAILS=<group> make those creates fail with the reason
(REASONS); STANDIN_VPC_DELETE_FAILS=1 leaves the VPC. No pdserve imports.
"""

from __future__ import annotations

import json
import os
import re
import sys
from typing import Any

# CloudFormation's ResourceStatusReason for each cause, in the services' own words (EC2 API error codes:
# AddressLimitExceeded, VcpuLimitExceeded; EKS CreateCluster: UnsupportedAvailabilityZoneException; IAM's
# "is not authorized to perform" for a denied call)
REASONS = {
    "eip": ("AWS::EC2::EIP", "NATIP", ("Resource handler returned message: \"The maximum number of addresses has been "
            "reached. (Service: Ec2, Status Code: 400, Request ID: 4a1b) (SDK Attempt Count: 1)\" (RequestToken: 9c2e, "
            "HandlerErrorCode: ServiceLimitExceeded)")),
    "zone": ("AWS::EKS::Cluster", "ControlPlane", ("Resource handler returned message: \"Cannot create cluster 'demo' "
             "because us-east-1e, the targeted availability zone, does not currently have sufficient capacity to "
             "support the cluster. Retry and choose from these availability zones: us-east-1a, us-east-1b, us-east-1c "
             "(Service: Eks, Status Code: 400, Request ID: 77d0)\" (HandlerErrorCode: GeneralServiceException) "
             "UnsupportedAvailabilityZoneException")),
    "iam": ("AWS::IAM::Role", "ServiceRole", ("Resource handler returned message: \"User: arn:aws:iam::123456789012:"
            "user/demo is not authorized to perform: iam:CreateRole on resource: arn:aws:iam::123456789012:role/"
            "eksctl-demo-cluster-ServiceRole because no identity-based policy allows the iam:CreateRole action "
            "(Service: Iam, Status Code: 403, Request ID: 1f3e)\" (HandlerErrorCode: AccessDenied)")),
    "vcpu": ("AWS::EKS::Nodegroup", "ManagedNodeGroup", ("Resource handler returned message: \"[Issue(Code="
             "AsgInstanceLaunchFailures, Message=Could not launch On-Demand Instances. VcpuLimitExceeded - You have "
             "requested more vCPU capacity than your current vCPU limit of 32 allows for the instance bucket that the "
             "specified instance type belongs to. Please visit http://aws.amazon.com/contact-us/ec2-request to request "
             "an adjustment to this limit. Launching EC2 instance failed., ResourceIds=[eks-gpu-0ec8])]\"")),
}
VPC_DELETE_FAILED = ("AWS::EC2::VPC", "VPC", ("The vpc 'vpc-0a1b2c3d' has dependencies and cannot be deleted. "
                                              "(Service: Ec2, Status Code: 400, Request ID: 5e6f)"))
# the statuses eksctl's node group listing skips (pkg/cfn/manager/nodegroup.go:251-256)
_NOT_LISTED = ("DELETE_COMPLETE", "DELETE_FAILED")


def stacks(state: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = state.setdefault("stacks", {})
    return found


def info(line: str) -> None:
    print(f"2026-12-08 00:00:00 [ℹ]  {line}")


def critical(line: str) -> None:
    print(f"2026-12-08 00:00:00 [✖]  {line}")


def error(line: str) -> int:
    print(f"Error: {line}", file=sys.stderr)
    return 1


def create_cluster(cluster: str, region: str, state: dict[str, Any]) -> int:
    """The cluster stack: created, refused over an existing stack, or rolled back with its CREATE_FAILED lines."""
    name = f"eksctl-{cluster}-cluster"
    info(f"if you encounter any issues, check CloudFormation console or try 'eksctl utils describe-stacks "
         f"--region={region} --cluster={cluster}'")
    failure = ""
    if name in stacks(state):
        failure = (f"creating CloudFormation stack \"{name}\": operation error CloudFormation: CreateStack, "
                   f"AlreadyExistsException: Stack [{name}] already exists")
    elif os.environ.get("STANDIN_CLUSTER_FAILS"):
        kind, logical, reason = REASONS[os.environ["STANDIN_CLUSTER_FAILS"]]
        stacks(state)[name] = {"status": "ROLLBACK_COMPLETE", "failed_reasons": [reason]}
        critical(f"unexpected status \"ROLLBACK_IN_PROGRESS\" while waiting for CloudFormation stack \"{name}\"")
        info("fetching stack events in attempt to troubleshoot the root cause of the failure")
        critical(f"{kind}/{logical}: CREATE_FAILED – {json.dumps(reason, ensure_ascii=False)}")
        failure = "waiter state transitioned to Failure"
    if failure:
        print("2026-12-08 00:00:00 [!]  1 error(s) occurred and cluster hasn't been created properly, you may wish "
              "to check CloudFormation console")
        info(f"to cleanup resources, run 'eksctl delete cluster --region={region} --name={cluster}'")
        critical(failure)
        return error(f"failed to create cluster \"{cluster}\"")
    stacks(state)[name] = {"status": "CREATE_COMPLETE", "failed_reasons": []}
    state["cluster"] = True
    return 0


def excluded_groups(cluster: str, wanted: list[str], state: dict[str, Any]) -> list[str]:
    """The groups of the config that have a listed stack; eksctl says it leaves them out."""
    listed = [group for group in wanted
              if stacks(state).get(f"eksctl-{cluster}-nodegroup-{group}", {}).get("status") not in (None, *_NOT_LISTED)]
    if listed:
        info(f"{len(listed)} existing nodegroup(s) ({','.join(listed)}) will be excluded")
    return listed


def node_group_created(cluster: str, group: str, state: dict[str, Any]) -> None:
    stacks(state)[f"eksctl-{cluster}-nodegroup-{group}"] = {"status": "CREATE_COMPLETE", "failed_reasons": []}


def node_group_failed(cluster: str, region: str, group: str, state: dict[str, Any], *, reason: str,
                      kind: str = "AWS::EKS::Nodegroup", logical: str = "ManagedNodeGroup") -> int:
    """A rolled-back node group stack: the group is gone, the stack stays ROLLBACK_COMPLETE."""
    name = f"eksctl-{cluster}-nodegroup-{group}"
    stacks(state)[name] = {"status": "ROLLBACK_COMPLETE", "failed_reasons": [reason]}
    state.setdefault("nodegroups", {}).pop(group, None)
    critical(f"unexpected status \"ROLLBACK_IN_PROGRESS\" while waiting for CloudFormation stack \"{name}\"")
    critical(f"{kind}/{logical}: CREATE_FAILED – {json.dumps(reason, ensure_ascii=False)}")
    info("1 error(s) occurred and nodegroups haven't been created properly, you may wish to check CloudFormation "
         "console")
    info(f"to cleanup resources, run 'eksctl delete nodegroup --region={region} --cluster={cluster} --name=<name>' "
         "for each of the failed nodegroups")
    critical("waiter state transitioned to Failure")
    return error(f"failed to create nodegroups for cluster \"{cluster}\"")


def delete_cluster(cluster: str, state: dict[str, Any]) -> int:
    """Node group stacks and the EKS cluster go; the cluster stack goes too unless its VPC cannot be deleted."""
    name = f"eksctl-{cluster}-cluster"
    for stack in [stack for stack in stacks(state) if stack.startswith(f"eksctl-{cluster}-nodegroup-")]:
        del stacks(state)[stack]
    for key in ("cluster", "nodegroups", "daemonsets"):
        state.pop(key, None)
    if name in stacks(state) and os.environ.get("STANDIN_VPC_DELETE_FAILS"):
        stacks(state)[name] = {"status": "DELETE_FAILED", "failed_reasons": [VPC_DELETE_FAILED[2]]}
        critical(f"unexpected status \"DELETE_FAILED\" while waiting for CloudFormation stack \"{name}\"")
        kind, logical, reason = VPC_DELETE_FAILED
        critical(f"{kind}/{logical}: DELETE_FAILED – {json.dumps(reason)}")
        return error("failed to delete cluster with nodegroup(s): waiter state transitioned to Failure")
    stacks(state).pop(name, None)
    return 0


def describe_stacks(words: list[str], state: dict[str, Any]) -> int:
    """aws cloudformation describe-stacks --query "Stacks[?starts_with(StackName, 'P')].{name: StackName, status:
    StackStatus}" (CloudFormation API DescribeStacks lists every stack but deleted ones; JMESPath's starts_with)."""
    query = words[words.index("--query") + 1]
    match = re.fullmatch(r"Stacks\[\?starts_with\(StackName, '([^']*)'\)\]\.\{name: StackName, status: StackStatus\}",
                         query)
    assert match, f"query not modelled: {query}"
    print(json.dumps([{"name": name, "status": stack["status"]} for name, stack in stacks(state).items()
                      if name.startswith(match.group(1)) and stack["status"] != "DELETE_COMPLETE"]))
    return 0


def version(tool: str, words: list[str]) -> int:
    """The tools' version commands, at STANDIN_<TOOL>_VERSION (default: releases of 2026)."""
    found = os.environ.get(f"STANDIN_{tool.upper()}_VERSION", {"eksctl": "0.231.0", "kubectl": "1.35.0",
                                                               "helm": "3.19.0"}[tool])
    if tool == "eksctl":
        print(found)
    elif tool == "kubectl":
        print(json.dumps({"clientVersion": {"major": found.split(".")[0], "minor": found.split(".")[1],
                                            "gitVersion": f"v{found}"}, "kustomizeVersion": "v5.7.1"}, indent=2))
    else:
        print(f"v{found}+g13654a5")
    return 0

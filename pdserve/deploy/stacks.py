"""Pure: eksctl's CloudFormation stacks of the cluster, as ``aws cloudformation describe-stacks`` lists them.

A failed create leaves its stack (ROLLBACK_COMPLETE: CloudFormation User Guide, "Stack status codes": such a
stack can only be deleted), which makes eksctl's next create fail (AlreadyExistsException) or, for a node
group, skip it (eksctl pkg/ctl/cmdutils/filter/nodegroup_filter.go:80-91 counts every listed stack as an
existing group; pkg/cfn/manager/api.go:552-570 lists ROLLBACK_COMPLETE). The stacks also say what still bills.
"""

from __future__ import annotations

import json

from pdserve.cluster_config import EksSpec
from pdserve.deploy.cost import EKSCTL_VOLUME_GIB, Charge, cluster_charges, node_charge
from pdserve.deploy.eksctl import GPU_NODE_GROUP, SYSTEM_NODE_GROUP
from pdserve.errors import DeployError

# a create that failed: the stack holds nothing that works and blocks the next create (CloudFormation's statuses)
FAILED_CREATE = ("ROLLBACK_COMPLETE", "ROLLBACK_FAILED", "CREATE_FAILED")
# rolled back or deleted: CloudFormation removed what the stack made, so it bills nothing
NOTHING_LEFT = ("ROLLBACK_COMPLETE", "DELETE_COMPLETE")


def cluster_stack(eks: EksSpec) -> str:
    """eksctl pkg/cfn/manager/cluster.go:31-33."""
    return f"eksctl-{eks.cluster_name}-cluster"


def node_group_stack(eks: EksSpec, group: str) -> str:
    """eksctl pkg/cfn/manager/nodegroup.go (eksctl-CLUSTER-nodegroup-NAME)."""
    return f"eksctl-{eks.cluster_name}-nodegroup-{group}"


def stacks_query(eks: EksSpec) -> tuple[str, ...]:
    """The cluster's stacks (every stack eksctl names eksctl-CLUSTER-*) with their status, as JSON."""
    query = f"Stacks[?starts_with(StackName, 'eksctl-{eks.cluster_name}-')].{{name: StackName, status: StackStatus}}"
    return ("aws", "cloudformation", "describe-stacks", "--region", eks.region, "--query", query, "--output", "json")


def parse_stacks(output: str) -> dict[str, str]:
    """Stack name -> status, from ``stacks_query``'s output."""
    try:
        return {str(item["name"]): str(item["status"]) for item in json.loads(output or "[]")}
    except (json.JSONDecodeError, KeyError, TypeError) as exc:
        raise DeployError(f"unexpected output from aws cloudformation describe-stacks: {exc!r}") from exc


def failed_create(output: str, *, stack: str, removal: str) -> str:
    """Why a re-run removes ``stack`` first ('' when it is absent or did not fail to create)."""
    status = parse_stacks(output).get(stack, "")
    if status not in FAILED_CREATE:
        return ""
    return (f"stack {stack} is {status} (a create that failed; eksctl would trip over it): "
            f"removing it first with `{removal}`")


def left_over(output: str) -> str:
    """For ``cloud down``: '' when no stack of the cluster is left, else why there is work (or what failed)."""
    stacks = parse_stacks(output)
    return "stacks left: " + ", ".join(f"{name} ({status})" for name, status in sorted(stacks.items())) if stacks else ""


def billed(eks: EksSpec, output: str) -> list[Charge]:
    """What still bills by the hour, from the stacks that hold resources (any but rolled back or deleted)."""
    stacks = {name: status for name, status in parse_stacks(output).items() if status not in NOTHING_LEFT}
    # a cluster stack that failed to delete has lost its control plane, not always its VPC's NAT gateway
    cluster = cluster_charges(eks)[-1:] if stacks.get(cluster_stack(eks)) == "DELETE_FAILED" else cluster_charges(eks)
    charges = cluster if cluster_stack(eks) in stacks else []
    groups = {SYSTEM_NODE_GROUP: (eks.system_instance_type, eks.system_nodes, EKSCTL_VOLUME_GIB),
              GPU_NODE_GROUP: (eks.gpu_instance_type, eks.gpu_nodes, eks.gpu_volume_gib)}
    for group, (instance_type, nodes, volume_gib) in groups.items():
        if node_group_stack(eks, group) in stacks:
            charges.append(node_charge(instance_type, nodes=nodes, volume_gib=volume_gib, what=f"node group {group}"))
    return charges

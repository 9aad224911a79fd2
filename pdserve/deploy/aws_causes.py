"""Pure: the known causes of a failed eksctl or AWS call, read from its output, each as one line saying what to do.

eksctl writes CloudFormation's CREATE_FAILED reasons to stdout (pkg/cfn/manager/waiters.go:42-44) and only
"failed to create cluster" to stderr; the AWS error codes below are the ones those reasons quote.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster_config import EksSpec


@dataclass(frozen=True, slots=True)
class Cause:
    """Error codes or messages that mark one cause, and what to do about it ({region} filled in)."""

    marks: tuple[str, ...]
    name: str
    todo: str


# EC2's and EKS's error codes (EC2 API "Error codes", EKS API errors) and the Service Quotas codes to raise
CAUSES = (
    Cause(("AccessDenied", "UnauthorizedOperation", "is not authorized to perform"), "missing IAM permission",
          "give the AWS identity the permission the line above names (eksctl's minimum IAM policies: "
          "https://eksctl.io/usage/minimum-iam-policies/), then run `pdserve cloud up` again"),
    Cause(("VcpuLimitExceeded", "more vCPU capacity than your current vCPU limit"), "vCPU quota",
          "ask for a higher On-Demand vCPU quota (`aws service-quotas request-service-quota-increase --service-code "
          "ec2 --quota-code L-DB2E81BA --desired-value N --region {region}` for G instances), or set fewer nodes"),
    Cause(("UnsupportedAvailabilityZoneException",), "zone EKS does not support",
          "list other zones in eks.availability_zones (the error names those EKS supports)"),
    Cause(("InsufficientInstanceCapacity",), "no EC2 capacity in the zone",
          "list more zones in eks.availability_zones, try again later, or reserve capacity"),
    Cause(("AddressLimitExceeded", "maximum number of addresses has been reached"), "Elastic IP quota",
          "release unused addresses (`aws ec2 describe-addresses --region {region}`) or ask for more "
          "(`aws service-quotas request-service-quota-increase --service-code ec2 --quota-code L-0263D0A3 "
          "--desired-value N --region {region}`); the cluster's NAT gateway needs one"),
    Cause(("VpcLimitExceeded", "maximum number of VPCs has been reached"), "VPC quota",
          "delete an unused VPC in {region} or ask for more (Service Quotas: vpc, L-F678F1CE)"),
    Cause(("NatGatewayLimitExceeded",), "NAT gateway quota",
          "delete an unused NAT gateway in the zone or ask for more (Service Quotas: vpc, L-FE5A380F)"),
)


def cause_lines(output: str, *, eks: EksSpec) -> str:
    """One line per known cause ``output`` shows ('' when none): the cause, then what to do."""
    found = [cause for cause in CAUSES if any(mark in output for mark in cause.marks)]
    return "\n".join(f"cause: {cause.name}: {cause.todo.format(region=eks.region)}" for cause in found)

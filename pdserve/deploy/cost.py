"""Pure: what the EKS deployment costs per hour while it runs, On-Demand in USD, as an estimate.

Prices are AWS's public On-Demand list prices for Linux in us-east-1 and us-west-2 (the EC2, EKS and VPC
pricing pages); other regions differ by a few percent. Data transfer and NAT traffic are left out.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdserve.cluster_config import EksSpec

INSTANCE_USD_PER_H = {"g6.xlarge": 0.8048, "g6.2xlarge": 0.9776, "g6.4xlarge": 1.3232, "g6.8xlarge": 2.0144,
                      "g6.12xlarge": 4.6016, "g6e.8xlarge": 4.5288, "g5.8xlarge": 2.448, "p5.48xlarge": 98.32,
                      "m7i.large": 0.1008, "m7i.xlarge": 0.2016, "m7i.2xlarge": 0.4032}
CONTROL_PLANE_USD_PER_H = 0.10  # EKS standard support
NAT_GATEWAY_USD_PER_H = 0.045  # eksctl's default VPC has one NAT gateway (a single one: eksctl's default)
GP3_USD_PER_GIB_MONTH = 0.08
HOURS_PER_MONTH = 730
# eksctl's root volume when the node group names none (pkg/apis/eksctl.io/v1alpha5/types.go:506-507)
EKSCTL_VOLUME_GIB = 80
PRICES_URL = "https://aws.amazon.com/ec2/pricing/on-demand/"


@dataclass(frozen=True, slots=True)
class Charge:
    """One thing that bills by the hour; ``usd_per_h`` None where the instance type's price is not listed here."""

    what: str
    usd_per_h: float | None


def cluster_charges(eks: EksSpec) -> list[Charge]:
    """The control plane and the NAT gateway, billed from ``eksctl create cluster`` on."""
    return [Charge(f"EKS control plane {eks.cluster_name}", CONTROL_PLANE_USD_PER_H),
            Charge("NAT gateway of the cluster's VPC", NAT_GATEWAY_USD_PER_H)]


def node_charge(instance_type: str, *, nodes: int, volume_gib: int, what: str) -> Charge:
    price = INSTANCE_USD_PER_H.get(instance_type)
    disk = volume_gib * GP3_USD_PER_GIB_MONTH / HOURS_PER_MONTH
    label = f"{nodes} x {instance_type} ({what}, {volume_gib} GiB gp3 each)"
    return Charge(label, None if price is None else nodes * (price + disk))


def plan_charges(eks: EksSpec) -> list[Charge]:
    """Everything ``cloud up`` makes that bills by the hour."""
    return [*cluster_charges(eks),
            node_charge(eks.system_instance_type, nodes=eks.system_nodes, volume_gib=EKSCTL_VOLUME_GIB,
                        what="system nodes"),
            node_charge(eks.gpu_instance_type, nodes=eks.gpu_nodes, volume_gib=eks.gpu_volume_gib, what="GPU nodes")]


def cost_lines(charges: list[Charge]) -> list[str]:
    """One line per charge and the total, e.g. ``  2 x g6.8xlarge (...): $4.07/h``."""
    lines = [f"  {charge.what}: " + (f"${charge.usd_per_h:.2f}/h" if charge.usd_per_h is not None
                                     else f"price not listed here ({PRICES_URL})") for charge in charges]
    total = sum(charge.usd_per_h or 0.0 for charge in charges)
    unknown = " plus the unlisted" if any(charge.usd_per_h is None for charge in charges) else ""
    return [*lines, f"  total: about ${total:.2f}/h{unknown} (On-Demand list prices; an estimate)"]

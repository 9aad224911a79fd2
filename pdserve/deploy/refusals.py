"""Every refusal ``render k8s`` and ``cloud up`` can make from the configuration file alone, made at once,
so ``pdserve config validate`` says all of them before anything starts. Pure; the checks live beside what
they guard (k8s.py, eksctl.py), and a new refusal is one more entry in a tuple here.
"""

from __future__ import annotations

from collections.abc import Callable

from pdserve.config import Settings
from pdserve.deploy.aws_preflight import image_refusal
from pdserve.deploy.eks import plan_up
from pdserve.deploy.eksctl import (
    check_efa_node_group,
    check_room_for_upgrades,
    gpu_node_labels,
    head_node_labels,
    unresolved_zones,
)
from pdserve.deploy.k8s import (
    check_gateway_port,
    check_gateway_replicas,
    check_writable_dirs,
    is_efa_on,
    render_manifests,
)
from pdserve.deploy.k8s_secrets import NewSecrets
from pdserve.errors import ConfigError

Check = Callable[[Settings], object]  # raises ConfigError naming the field; what it returns is not used


def _check_image_placeholder(settings: Settings) -> None:
    """``cloud up`` refuses an image that still holds a placeholder before anything is created."""
    if refusal := image_refusal(settings):
        raise ConfigError(refusal)


def _plan_cloud_up(settings: Settings) -> object:
    """The plan ``cloud up --dry-run`` prints, before the zones are looked up; no key is shown."""
    return plan_up(settings, zones=unresolved_zones(settings.eks), secrets=NewSecrets.generate())


# Each check is independent, so every refusal is reported; the renderers come last and repeat what the
# checks said (dropped as duplicates), so a refusal they learn later is never passed by validate.
KUBERNETES_CHECKS: tuple[Check, ...] = (check_gateway_port, check_gateway_replicas, check_writable_dirs, is_efa_on,
                                        render_manifests)
EKS_CHECKS: tuple[Check, ...] = (check_efa_node_group, check_room_for_upgrades, gpu_node_labels, head_node_labels,
                                 _check_image_placeholder, _plan_cloud_up)
KUBERNETES_SECTIONS = frozenset({"kubernetes", "eks"})


def cluster_refusals(settings: Settings) -> list[str]:
    """What ``render k8s`` would refuse, when the configuration sets ``kubernetes`` or ``eks``, and what
    ``cloud up`` would refuse, when it sets ``eks``; each message once, in check order. A configuration
    for one machine or a Ray cluster sets neither, and is not held to a cluster's rules."""
    sections = settings.model_fields_set
    checks = KUBERNETES_CHECKS if sections & KUBERNETES_SECTIONS else ()
    if "eks" in sections:
        checks += EKS_CHECKS
    return list(dict.fromkeys(problem for check in checks if (problem := _refusal(check, settings))))


def check_cluster_config(settings: Settings) -> None:
    """Raises ConfigError with every refusal of ``cluster_refusals``, one per line."""
    if problems := cluster_refusals(settings):
        raise ConfigError("\n".join(problems))


def _refusal(check: Check, settings: Settings) -> str | None:
    try:
        check(settings)
    except ConfigError as exc:
        return str(exc)
    return None

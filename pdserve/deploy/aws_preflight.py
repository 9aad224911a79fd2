"""Pure: what ``cloud up`` checks with AWS before it creates anything, as the plan's first steps.

In the order a user would want to hear of a problem, each a read-only call of seconds: the tools' versions, the credentials
(in the region), the two instance types and the vCPU quotas their nodes count against, the zones that
offer them, and the image. An image name with a placeholder is refused before any call. No I/O:
``cloud.py`` runs these steps, ``runner.py`` hands their output here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from functools import partial
from typing import Any

from pdserve.cluster_config import EksSpec
from pdserve.config import Settings
from pdserve.deploy.eksctl import choose_zones, zone_query
from pdserve.deploy.steps import Step
from pdserve.deploy.tool_versions import version_steps
from pdserve.errors import DeployError

INSTANCE_TYPES_STEP = "instance-types"
ZONES_STEP = "zones"
# EC2's On-Demand vCPU quotas per instance family, as Service Quotas names them (service code ec2; the EC2
# User Guide's "On-Demand Instance quotas"). Only these families are checked: others have quotas of their own.
# The letters before a family's generation digit: gr6 is a G instance, im4gn and is4gen are I instances.
VCPU_QUOTAS = {
    "L-DB2E81BA": ("Running On-Demand G and VT instances", ("g", "gr", "vt")),
    "L-417A185B": ("Running On-Demand P instances", ("p",)),
    "L-1216C47A": ("Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances",
                   (*"acdhimrtz", "im", "is")),
}
_FAMILY = re.compile(r"^([a-z]+)")
# ACCOUNT.dkr.ecr.REGION.amazonaws.com[.cn]/REPOSITORY[:TAG][@sha256:DIGEST], as ECR names private images; the
# account may be the example's placeholder, so that a dry run shows the check (a real run refuses it first)
_ECR_IMAGE = re.compile(r"^(?P<account>\d{12}|<[^<>]*>)\.dkr\.ecr\.(?P<region>[a-z0-9-]+)\.amazonaws\.com(?:\.cn)?/"
                        r"(?P<repository>[^:@]+)(?::(?P<tag>[^@]+))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")
_PLACEHOLDER = re.compile(r"<[^<>]*>")
_IDENTITY_FIX = ("Fix: give the AWS CLI credentials for the account (`aws configure`, or `aws sso login` with "
                 "AWS_PROFILE set, or AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY), and set eks.region to a region "
                 "the account has enabled")


def preflight_steps(settings: Settings) -> list[Step]:
    """The checks, in order; ``cloud up`` runs them before its plan and stops at the first that fails."""
    eks, image = settings.eks, settings.kubernetes.image
    return [
        *version_steps(eks),
        Step("aws-identity", ("aws", "sts", "get-caller-identity", "--region", eks.region, "--output", "json"),
             check_output=_identity_problem, fix=_IDENTITY_FIX,
             about=f"preflight: AWS credentials, answered from {eks.region}"),
        Step(INSTANCE_TYPES_STEP, ("aws", "ec2", "describe-instance-types", "--instance-types", *_instance_types(eks),
                                   "--region", eks.region, "--output", "json"),
             check_output=partial(_instance_types_problem, eks=eks),
             fix="Fix: set eks.gpu_instance_type and eks.system_instance_type to EC2 instance types",
             about="preflight: the instance types exist; their vCPUs, for the quotas"),
        *(step for code in dict.fromkeys(map(_quota_code, _instance_types(eks))) if code
          for step in _quota_steps(eks, code)),
        Step(ZONES_STEP, zone_query(eks), check_output=partial(_zones_problem, eks=eks),
             about=f"preflight: zones offering {eks.gpu_instance_type} (the GPU node group tries them in turn) "
                   f"and {eks.system_instance_type}"),
        *_image_steps(image),
    ]


def image_refusal(settings: Settings) -> str:
    """'' unless ``kubernetes.image`` still holds a placeholder such as ``<account>``: then why ``cloud up``
    refuses to start (every node would fail to pull it, after the cluster was made)."""
    image = settings.kubernetes.image
    found = _PLACEHOLDER.findall(image)
    if not found:
        return ""
    return (f"kubernetes.image is {image}, and {', '.join(found)} is a placeholder: no node could pull it. Set it to "
            "the image you pushed (docs/deploy.md, Image), e.g. 123456789012.dkr.ecr.us-west-2.amazonaws.com/pdserve:0.1.0")


def image_note(settings: Settings) -> str:
    """What the preflight says of an image it does not look up ('' for an ECR image, which it does)."""
    image = settings.kubernetes.image
    if _ECR_IMAGE.match(image):
        return ""
    return (f"preflight: the image {image} is not in a private ECR registry, so it is first pulled by the "
            "image-ray-version step, once the nodes exist: other registries need their own clients and "
            "credentials, which pdserve does not ask for")


def _instance_types(eks: EksSpec) -> tuple[str, ...]:
    return tuple(dict.fromkeys((eks.gpu_instance_type, eks.system_instance_type)))


def _identity_problem(output: str) -> str:
    account = str(_json(output, what="aws sts get-caller-identity").get("Account", ""))
    return "" if account else f"aws sts get-caller-identity named no account: {output.strip()[:200]!r}"


def _instance_types_problem(output: str, *, eks: EksSpec) -> str:
    missing = [name for name in _instance_types(eks) if name not in _vcpus_by_type(output)]
    return f"EC2 in {eks.region} does not describe {', '.join(missing)}" if missing else ""


def _vcpus_by_type(output: str) -> dict[str, int]:
    """``describe-instance-types``: InstanceTypes[].VCpuInfo.DefaultVCpus (EC2 API, InstanceTypeInfo)."""
    described = _json(output, what="aws ec2 describe-instance-types").get("InstanceTypes", [])
    return {info["InstanceType"]: int(info["VCpuInfo"]["DefaultVCpus"]) for info in described}


def _quota_code(instance_type: str) -> str:
    family = _FAMILY.match(instance_type)
    letters = family.group(1) if family else ""
    return next((code for code, (_, families) in VCPU_QUOTAS.items() if letters in families), "")


def _quota_steps(eks: EksSpec, code: str) -> list[Step]:
    """The account's value of the quota where it has one, then AWS's default, which holds where it has none
    (GetServiceQuota answers NoSuchResourceException for a quota never applied to the account; GetAWSDefaultServiceQuota
    gives "the default value ... [without] any quota increases": Service Quotas API Reference). The check reads the
    first where it ran."""
    name, _ = VCPU_QUOTAS[code]
    counted = ", ".join(f"{count} x {kind}" for kind, count in _node_counts(eks) if _quota_code(kind) == code)
    where = ("--service-code", "ec2", "--quota-code", code, "--region", eks.region, "--output", "json")
    applied = ("aws", "service-quotas", "get-service-quota", *where)
    return [Step(f"quota-{code}", applied, only_if=applied,
                 about=f"preflight: the account's value of the vCPU quota {name!r} in {eks.region}, where it has one"),
            Step(f"quota-{code}-default", ("aws", "service-quotas", "get-aws-default-service-quota", *where),
                 check_outputs=partial(_quota_problem, eks=eks, code=code),
                 fix="Fix: the AWS identity needs servicequotas:GetServiceQuota and servicequotas:GetAWSDefaultServiceQuota",
                 about=f"preflight: the vCPU quota {name!r} in {eks.region} (the account's, else AWS's default) covers "
                       f"{counted}")]


def _node_counts(eks: EksSpec) -> list[tuple[str, int]]:
    return [(eks.gpu_instance_type, eks.gpu_nodes), (eks.system_instance_type, eks.system_nodes)]


def _quota_problem(outputs: Mapping[str, str], *, eks: EksSpec, code: str) -> str:
    """'' when the quota (GetServiceQuota: Quota.Value, vCPUs) covers every node counted against it."""
    vcpus = _vcpus_by_type(outputs[INSTANCE_TYPES_STEP])
    counted = [(kind, count) for kind, count in _node_counts(eks) if _quota_code(kind) == code]
    needed = sum(count * vcpus[kind] for kind, count in counted)
    output = outputs.get(f"quota-{code}") or outputs[f"quota-{code}-default"]
    quota = _json(output, what="aws service-quotas get-service-quota").get("Quota", {})
    value = float(quota.get("Value", 0.0))
    if value >= needed:
        return ""
    nodes = " and ".join(f"{count} x {kind} ({vcpus[kind]} vCPUs each)" for kind, count in counted)
    return (f"the quota {quota.get('QuotaName', VCPU_QUOTAS[code][0])!r} ({code}) in {eks.region} is {value:g} vCPUs, "
            f"but {nodes} need {needed}; EC2 would refuse the node group's instances tens of minutes into `cloud up` "
            f"(instances already running in the account count against it too). Fix: ask for {needed} or more with "
            f"`aws service-quotas request-service-quota-increase --service-code ec2 --quota-code {code} "
            f"--desired-value {needed} --region {eks.region}`, or in the Service Quotas console "
            f"(https://console.aws.amazon.com/servicequotas/home/services/ec2/quotas/{code}), and run `cloud up` once "
            "it is granted; or set fewer nodes or a smaller instance type")


def _zones_problem(output: str, *, eks: EksSpec) -> str:
    try:
        choose_zones(output, eks)
    except DeployError as exc:
        return str(exc)
    return ""


def _image_steps(image: str) -> list[Step]:
    """``aws ecr describe-images`` for a private ECR image; none for another registry."""
    found = _ECR_IMAGE.match(image)
    if found is None:
        return []
    digest, tag = found.group("digest"), found.group("tag") or "latest"
    image_id = f"imageDigest={digest}" if digest else f"imageTag={tag}"
    repository, account = found.group("repository"), found.group("account")
    return [Step("image", ("aws", "ecr", "describe-images", "--registry-id", account, "--repository-name", repository,
                           "--image-ids", image_id, "--region", found.group("region"), "--output", "json"),
                 check_output=partial(_image_problem, image=image),
                 # the API's errors (ECR API reference, DescribeImages): ImageNotFoundException,
                 # RepositoryNotFoundException; the CLI prints them on stderr, above this fix
                 fix=(f"Fix: push the image (docs/deploy.md, Image): `docker push {image}`; a missing repository "
                      f"first needs `aws ecr create-repository --repository-name {repository} --region "
                      f"{found.group('region')}`. Or set kubernetes.image to an image that exists"),
                 about=f"preflight: the image {image} is in ECR")]


def _image_problem(output: str, *, image: str) -> str:
    details = _json(output, what="aws ecr describe-images").get("imageDetails", [])
    return "" if details else f"ECR describes no image {image}"


def _json(output: str, *, what: str) -> dict[str, Any]:
    try:
        parsed = json.loads(output)
    except json.JSONDecodeError as exc:
        raise DeployError(f"unexpected output from {what}: {exc!r}") from exc
    if not isinstance(parsed, dict):
        raise DeployError(f"unexpected output from {what}: {output.strip()[:200]!r}")
    return parsed

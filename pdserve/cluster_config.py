"""The cluster parts of the configuration tree (config.py's Settings): the Ray Serve application
(``ray``, with its pools' autoscaling), the KubeRay objects (``kubernetes``) and the EKS cluster (``eks``)."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from pdserve.role import Role
from pdserve.spec_base import FrozenSpec

# A prefill engine computes a few prompts at a time; a decode engine batches many streams.
DEFAULT_TARGET_REQUESTS = {Role.PREFILL: 4.0, Role.DECODE: 32.0}


class PoolScalingSpec(FrozenSpec):
    """One pool's bounds on Ray, and the load per engine Serve sizes it for (pdserve/ray/pool_size.py)."""

    min_engines: int = Field(1, ge=1, description=(
        "fewest engines; at least 1, since an empty pool reports no load to grow from"))
    max_engines: int = Field(4, ge=1, description="most engines; Ray must have the nodes and resources for them")
    target_requests: float = Field(gt=0, description=(
        "running + waiting requests per engine, as the engine's /metrics counts them: more grows the pool"))
    max_kv_usage: float = Field(0.8, gt=0, le=1, description=(
        "KV cache use per engine (0..1) to stay under: more grows the pool"))

    @model_validator(mode="after")
    def _check_bounds(self) -> PoolScalingSpec:
        if self.max_engines < self.min_engines:
            raise ValueError("max_engines must be at least min_engines")
        return self


class RayAutoscalingSpec(FrozenSpec):
    """Ray Serve grows and shrinks each pool with its engines' own load (pdserve/ray/autoscaling.py)."""

    enabled: bool = Field(False, description="on: Serve sizes the pools and ignores their `engines`")
    prefill: PoolScalingSpec = PoolScalingSpec(target_requests=DEFAULT_TARGET_REQUESTS[Role.PREFILL])
    decode: PoolScalingSpec = PoolScalingSpec(target_requests=DEFAULT_TARGET_REQUESTS[Role.DECODE])
    upscale_delay_s: float = Field(30.0, ge=0, description="a pool grows once its load has asked for it this long")
    downscale_delay_s: float = Field(600.0, ge=0, description=(
        "a pool shrinks, by one engine, once its load has asked for it this long (an engine takes minutes to start)"))

    def pool(self, role: Role) -> PoolScalingSpec:
        return self.prefill if role is Role.PREFILL else self.decode

    @model_validator(mode="before")
    @classmethod
    def _pool_target_defaults(cls, tree: Any) -> Any:
        """``decode: {max_engines: 8}`` keeps the decode pool's own default target."""
        if not isinstance(tree, dict):
            return tree
        pools = {role.value: {"target_requests": target, **tree[role.value]}
                 for role, target in DEFAULT_TARGET_REQUESTS.items() if isinstance(tree.get(role.value), dict)}
        return {**tree, **pools}


class RaySpec(FrozenSpec):
    """``pdserve ray up`` and ``render serve``: the Ray Serve application on a running cluster."""

    address: str = Field("http://127.0.0.1:8265", description=(
        "the cluster's dashboard, as `serve deploy --address` takes it"))
    app_name: str = Field("pdserve", description="Serve application name")
    gateway_cpus: float = Field(1.0, ge=0, description=(
        "CPUs reserved for each gateway replica; 0 = none: it shares its node's cores (a 2-core laptop's go to the "
        "engines)"))
    gateway_resources: dict[str, float] = Field(default_factory=dict, description=(
        "Ray custom resources for the gateway replica, e.g. {head: 1}"))
    health_check_period_s: float = Field(2.0, gt=0, description=(
        "how often Serve asks each engine replica for its engine's /health"))
    engine_unresponsive_s: float = Field(60.0, gt=0, description=(
        "a running engine that has not answered /health this long is replaced; one that exited is at once"))
    deploy_timeout_s: float = Field(900.0, gt=0, description="`ray up` waits this long for the app to serve")
    drain_timeout_s: float = Field(300.0, gt=0, description=(
        "an engine replica Serve stops (scale-down, replacement, `ray down`) leaves the gateway, then its engine "
        "may finish what it runs this long before it is stopped anyway"))
    autoscaling: RayAutoscalingSpec = RayAutoscalingSpec()


class KubernetesSpec(FrozenSpec):
    """``pdserve render k8s``: the KubeRay RayService and its companions."""

    name: str = Field("pdserve", description="RayService name; prefix of every object")
    namespace: str = Field("pdserve", description="namespace of every object")
    image: str = Field(f"pdserve:{version('pdserve')}", description=(
        "container image (see Dockerfile) on head and workers; the default is this release's tag, never `latest`"))
    ray_version: str = Field("2.60.0", description="Ray version inside the image")
    head_cpus: float = Field(2.0, gt=0)
    head_memory_gib: float = Field(8.0, gt=0)
    head_node_labels: dict[str, str] = Field(default_factory=lambda: {"pdserve.io/node-role": "system"}, description=(
        "nodeSelector for the CPU-only head (Ray head, gateway)"))
    shm_gib: float = Field(16.0, gt=0, description="/dev/shm per engine pod (NCCL, vLLM workers)")
    pod_monitor: bool = Field(True, description=(
        "render PodMonitors for the gateway's and the engines' /metrics (needs the Prometheus Operator's CRDs)"))
    grafana_dashboard: bool = Field(True, description=(
        "render pdserve's Grafana dashboard as a ConfigMap labelled grafana_dashboard: \"1\" for Grafana's sidecar"))
    monitor_labels: dict[str, str] = Field(default_factory=lambda: {"release": "kube-prometheus-stack"}, description=(
        "labels on the PodMonitors: kube-prometheus-stack's Prometheus selects only those labelled with its Helm "
        "release (release: <release name>)"))
    upgrade: Literal["recreate", "new_cluster"] = Field("recreate", description=(
        "how a change of the pods (image, resources) rolls out: recreate = KubeRay's upgradeStrategy None, and "
        "`cloud up` replaces the RayService (the engines restart; fits fixed GPU node groups); new_cluster = "
        "KubeRay's NewCluster, which needs room for a second set of engine pods"))
    kuberay_namespace: str = Field("kuberay-system", description=(
        "namespace of the KubeRay operator (`cloud up` installs it there): the NetworkPolicies let only its pods "
        "reach the Ray dashboard"))
    prometheus_namespace: str = Field("monitoring", description=(
        "namespace of the Prometheus that scrapes the engines: the NetworkPolicies let only its Prometheus pods "
        "(app.kubernetes.io/name: prometheus) reach the engines' port"))
    model_cache_path: str = Field("/var/lib/pdserve/cache", description=(
        "a directory on each GPU node (hostPath) for downloaded weights and vLLM's compile cache, so a replaced "
        "engine pod neither downloads nor compiles again and finds the weights in the page cache; empty = none"))


class EksSpec(FrozenSpec):
    """``pdserve cloud``: the EKS cluster the Kubernetes objects run on."""

    cluster_name: str = Field("pdserve", description="eksctl cluster name")
    region: str = Field("us-west-2", description="AWS region")
    availability_zones: list[str] = Field(default_factory=list, description=(
        "zones the GPU node group may use, in order (EFA needs all its nodes in one): `cloud up` creates it in "
        "the first and moves to the next when EC2 has no capacity there (InsufficientInstanceCapacity); empty = "
        "every zone of the region that offers gpu_instance_type, sorted"))
    # eksctl's own default is 1.34, at the end of its standard support; 1.35 is the newest it knows
    # (pkg/apis/eksctl.io/v1alpha5/types.go Version1_35), accepted where EKS lists it (pkg/eks/versions_manager.go)
    kubernetes_version: str = Field("1.35", description="EKS control plane version")
    system_instance_type: str = Field("m7i.xlarge", description="CPU-only system nodes (Ray head, KubeRay)")
    system_nodes: int = Field(1, ge=1)
    gpu_instance_type: str = Field("g6.8xlarge", description="GPU worker nodes (one engine each)")
    gpu_nodes: int = Field(2, ge=0)
    efa: bool = Field(True, description="EFA on the GPU node group (eksctl efaEnabled)")
    kuberay_version: str = Field("1.6.2", description=(
        "KubeRay operator Helm chart version; token auth through authOptions.secretName needs 1.6 or newer"))
    gpu_volume_gib: int = Field(200, ge=20, description="root disk per GPU node: the image and the weights")
    ready_timeout_s: float = Field(3600.0, gt=0, description=(
        "`cloud up` waits this long for the app to serve: image pulls and weight downloads"))

    @field_validator("availability_zones")
    @classmethod
    def _zones_once(cls, zones: list[str]) -> list[str]:
        if len(set(zones)) < len(zones):
            raise ValueError("names a zone more than once")
        return zones

"""The names, labels and ports every rendered Kubernetes object agrees on. Pure lookups, no I/O.

``pdserve cloud`` finds the objects ``render k8s`` wrote through these, so both stay in step.
"""

from __future__ import annotations

from pdserve.access import ADMIN_KEY_ENV, API_KEYS_ENV
from pdserve.cluster_config import KubernetesSpec
from pdserve.role import Role

# KubeRay finds Ray's ports on the head by these names (its head Service, its health checks).
RAY_HEAD_PORTS = {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080}
# Bound on the head too, but not published: the dashboard agent's HTTP server.
RAY_HEAD_PRIVATE_PORTS = {"dashboard-agent": 52365}
GATEWAY_PORT_NAME = "openai"
ENGINE_PORT_NAME = "vllm"  # each worker pod's engine API (and its /metrics): the pool's base_port
# KubeRay's own key for the token in a Ray auth Secret, so `authOptions.secretName` can name ours.
RAY_TOKEN_SECRET_KEY = "auth_token"
# The gateway's access keys (docs/reliability.md): client keys comma-separated, and the admin key.
API_KEYS_SECRET_KEYS = {API_KEYS_ENV: "api_keys", ADMIN_KEY_ENV: "admin_key"}
# The engine key (pdserve/engine_key.py), under this key of its Secret.
ENGINE_KEY_SECRET_KEY = "engine_key"
# Ray's own ports on every Ray pod, pinned (Ray picks the first three at random: ray/_private/parameter.py) so the
# NetworkPolicies can name them; the worker range is Ray's default (ray/scripts/scripts.py), made explicit.
RAY_NODE_PORTS = {"node-manager-port": 6380, "object-manager-port": 6381, "dashboard-agent-grpc-port": 6382}
RAY_WORKER_PORTS = {"min-worker-port": 10002, "max-worker-port": 19999}
RAY_AGENT_HTTP_PORT = 52365  # KubeRay's dashboard-agent-listen-port (common/pod.go, setMissingRayStartParams)
# UCX's TCP transport listens on a port of this range in each engine (UCX_TCP_PORT_RANGE: uct/tcp/tcp_iface.c,
# uct_tcp_iface_server_init), not on one the kernel picks, so the engines' NetworkPolicy can name it.
UCX_TCP_PORTS = (20000, 20099)
HEAD_COMPONENT = "head"
GATEWAY_COMPONENT = "gateway"
GATEWAY_POD_LABEL = "pdserve.io/gateway"  # "true" on each pod a gateway replica runs on
HF_TOKEN_SECRET_KEY = "token"


def object_labels(spec: KubernetesSpec, component: str) -> dict[str, str]:
    """Labels on every object and pod: what it is (``component``) and which deployment owns it."""
    return {
        "app.kubernetes.io/name": "pdserve",
        "app.kubernetes.io/instance": spec.name,
        "app.kubernetes.io/component": component,
    }


def object_metadata(spec: KubernetesSpec, name: str, component: str) -> dict[str, object]:
    """``metadata`` of a namespaced object of this deployment."""
    return {"name": name, "namespace": spec.namespace, "labels": object_labels(spec, component)}


def gateway_selector(spec: KubernetesSpec) -> dict[str, str]:
    """Selects the pods a gateway replica runs on: the head, or with ``gateway.replicas`` > 1 the
    pods of the ``gateway`` worker group.

    Not by ``ray.io/cluster``: a RayService names its RayCluster ``<name>-<suffix>`` and replaces
    it on upgrades, so that label changes; the instance label from the pod template does not.
    """
    return {"app.kubernetes.io/instance": spec.name, GATEWAY_POD_LABEL: "true"}


def component_selector(spec: KubernetesSpec, *components: str) -> dict[str, object]:
    """Selects this deployment's pods of the given components (``head``, ``gateway``, ``prefill``, ``decode``)."""
    return {"matchLabels": {"app.kubernetes.io/instance": spec.name},
            "matchExpressions": [{"key": "app.kubernetes.io/component", "operator": "In", "values": list(components)}]}


def engine_selector(spec: KubernetesSpec) -> dict[str, object]:
    """Selects every engine pod of this deployment: the worker pods of both pools."""
    return component_selector(spec, *(role.value for role in Role))


def ray_selector(spec: KubernetesSpec) -> dict[str, object]:
    """Selects every Ray pod of this deployment: head, gateway workers and engine workers."""
    return component_selector(spec, HEAD_COMPONENT, GATEWAY_COMPONENT, *(role.value for role in Role))


def ray_token_secret_name(spec: KubernetesSpec) -> str:
    """The Secret the user creates with the cluster's Ray token under ``RAY_TOKEN_SECRET_KEY``."""
    return f"{spec.name}-ray-token"


def api_keys_secret_name(spec: KubernetesSpec) -> str:
    """The Secret with the gateway's keys under ``API_KEYS_SECRET_KEYS``' values."""
    return f"{spec.name}-api-keys"


def engine_key_secret_name(spec: KubernetesSpec) -> str:
    """The Secret with the engine key under ``ENGINE_KEY_SECRET_KEY``."""
    return f"{spec.name}-engine-key"


def hf_token_secret_name(spec: KubernetesSpec) -> str:
    """The Secret the user may create with a Hugging Face token under ``HF_TOKEN_SECRET_KEY``."""
    return f"{spec.name}-hf-token"


def gateway_service_name(spec: KubernetesSpec) -> str:
    """The Service in front of the gateway's OpenAI port: pdserve's ClusterIP Service, or with
    ``upgrade: new_cluster`` KubeRay's head Service, which KubeRay moves to a new cluster only once its
    Serve app runs (and which carries every port of the head container, ``openai`` included)."""
    return f"{spec.name}-head-svc" if spec.upgrade == "new_cluster" else f"{spec.name}-gateway"

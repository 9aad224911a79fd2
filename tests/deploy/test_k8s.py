"""The rendered Kubernetes objects: valid against KubeRay's CRD and Kubernetes' own schemas, and right.

Golden file: ``PDSERVE_UPDATE_GOLDEN=1 pytest tests/deploy`` rewrites tests/deploy/golden/*.yaml;
review the diff like code.
"""

from __future__ import annotations

import json
import os
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from typer.testing import CliRunner

from pdserve.cli import app
from pdserve.cluster_config import KubernetesSpec
from pdserve.config import Settings, load_settings
from pdserve.deploy.k8s import kubernetes_settings, render_manifests, render_yaml, secrets_comment, write_manifests
from pdserve.deploy.k8s_names import RAY_TOKEN_SECRET_KEY, ray_token_secret_name
from pdserve.deploy.k8s_secrets import secrets_note
from pdserve.deploy.preflight import image_check_pod
from pdserve.deploy.rayservice import ray_resources_param
from pdserve.deploy.serve import serve_config
from pdserve.errors import ConfigError

REPO = Path(__file__).parents[2]
EKS_EXAMPLE = REPO / "examples" / "eks-g6-efa.yaml"
GOLDEN = Path(__file__).parent / "golden" / "eks-g6-efa.yaml"
# CI checks out the project with ../shared beside it; the schemas are data, not a dependency.
CRD_FILE = REPO.parent / "shared" / "schemas" / "kuberay" / "ray.io_rayservices.yaml"


def eks() -> Settings:
    return load_settings(EKS_EXAMPLE)


def defaults() -> Settings:
    """The defaults plus the one change ``render k8s`` asks for: a gateway port Ray does not use."""
    return load_settings(None, overrides={"gateway.port": 9000})


CONFIGS = {"eks-g6-efa": eks, "defaults": defaults}
# What every Ray pod's rayStartParams pin, for the NetworkPolicies (Ray picks the first three at random otherwise).
PINNED_RAY_PORTS = {"node-manager-port": "6380", "object-manager-port": "6381", "dashboard-agent-grpc-port": "6382",
                    "min-worker-port": "10002", "max-worker-port": "19999"}


@pytest.fixture(params=sorted(CONFIGS))
def manifests(request: pytest.FixtureRequest) -> dict[str, dict[str, Any]]:
    """The objects by kind; of two of a kind the first (the gateway's PodMonitor: tests/deploy/test_monitoring.py
    checks the engines')."""
    return {obj["kind"]: obj for obj in reversed(render_manifests(CONFIGS[request.param]()))}


def rayservice_schema() -> dict[str, Any]:
    if not CRD_FILE.is_file():
        pytest.fail(f"KubeRay's RayService CRD is missing at {CRD_FILE}: check out ../shared beside the project")
    crd = yaml.safe_load(CRD_FILE.read_text())
    (v1,) = [version for version in crd["spec"]["versions"] if version["name"] == "v1"]
    schema: dict[str, Any] = v1["schema"]["openAPIV3Schema"]
    return schema


def pruned_fields(obj: Any, schema: dict[str, Any], path: str = "") -> list[str]:
    """Fields the API server would silently drop: set by us, unknown to a structural schema."""
    if isinstance(obj, dict) and "properties" in schema:
        found = [f"{path}.{key}" for key in obj if key not in schema["properties"]]
        for key, value in obj.items():
            if key in schema["properties"]:
                found += pruned_fields(value, schema["properties"][key], f"{path}.{key}")
        return found
    if isinstance(obj, list) and "items" in schema:
        return [field for index, item in enumerate(obj)
                for field in pruned_fields(item, schema["items"], f"{path}[{index}]")]
    return []


def rayservice_of(objects: list[dict[str, Any]]) -> dict[str, Any]:
    (only,) = [obj for obj in objects if obj["kind"] == "RayService"]
    return only


def ray_groups(rayservice: dict[str, Any]) -> dict[str, dict[str, Any]]:
    cluster = rayservice["spec"]["rayClusterConfig"]
    return {"head": cluster["headGroupSpec"]} | {group["groupName"]: group for group in cluster["workerGroupSpecs"]}


def container(group: dict[str, Any]) -> dict[str, Any]:
    (only,) = group["template"]["spec"]["containers"]
    result: dict[str, Any] = only
    return result


def env(group: dict[str, Any]) -> dict[str, Any]:
    return {var["name"]: var.get("value", var.get("valueFrom")) for var in container(group)["env"]}


def test_rayservice_validates_against_the_kuberay_crd(manifests: dict[str, dict[str, Any]]) -> None:
    schema = rayservice_schema()
    jsonschema.validate(manifests["RayService"], schema, cls=jsonschema.Draft7Validator)
    assert pruned_fields(manifests["RayService"], schema) == []


@pytest.mark.parametrize("kind", ["Namespace", "Service", "ConfigMap"])
def test_core_objects_validate_against_kubernetes_schemas(manifests: dict[str, dict[str, Any]], kind: str) -> None:
    kubernetes_validate.validate(manifests[kind], eks().eks.kubernetes_version + ".0", strict=True)


def test_ray_pod_templates_validate_against_kubernetes_schemas(manifests: dict[str, dict[str, Any]]) -> None:
    """The CRD embeds the pod spec loosely; Kubernetes' strict schema also rejects unknown fields."""
    for name, group in ray_groups(manifests["RayService"]).items():
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": name},
                        "template": group["template"]}
        kubernetes_validate.validate(pod_template, eks().eks.kubernetes_version + ".0", strict=True)


def test_pod_monitor_scrapes_the_gateway_metrics_on_the_head(manifests: dict[str, dict[str, Any]]) -> None:
    monitor, service = manifests["PodMonitor"], manifests["Service"]
    assert (monitor["apiVersion"], monitor["metadata"]["namespace"]) == ("monitoring.coreos.com/v1", "pdserve")
    assert monitor["spec"]["selector"] == {"matchLabels": service["spec"]["selector"]}
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics" and endpoint["port"] == "openai"
    head = ray_groups(manifests["RayService"])["head"]
    assert service["spec"]["selector"].items() <= head["template"]["metadata"]["labels"].items()


def test_service_fronts_the_gateway_port_of_the_head_container(manifests: dict[str, dict[str, Any]]) -> None:
    service = manifests["Service"]
    (port,) = service["spec"]["ports"]
    head = container(ray_groups(manifests["RayService"])["head"])
    head_ports = {entry["name"]: entry["containerPort"] for entry in head["ports"]}
    assert service["spec"]["type"] == "ClusterIP"
    assert port == {"name": "openai", "port": 9000, "targetPort": "openai", "protocol": "TCP"}
    assert head_ports == {"gcs-server": 6379, "dashboard": 8265, "client": 10001, "serve": 8000, "metrics": 8080,
                          "openai": 9000}


def test_serve_config_v2_is_the_serve_config_of_the_derived_settings() -> None:
    settings = eks()
    rayservice = rayservice_of(render_manifests(settings))
    assert yaml.safe_load(rayservice["spec"]["serveConfigV2"]) == serve_config(kubernetes_settings(settings))


def test_efa_pools_request_efa_and_a_gpu_and_move_kv_over_libfabric() -> None:
    rayservice = rayservice_of(render_manifests(eks()))
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["kv"]["backends"] == ["LIBFABRIC"]
    assert args["kv"]["buffer_device"] == "cpu"  # a g6's EFA cannot read the L4's memory in place
    for role in ("prefill", "decode"):
        group = ray_groups(rayservice)[role]
        resources = container(group)["resources"]
        assert resources["limits"] == resources["requests"] == {
            "cpu": "24", "memory": "96Gi", "nvidia.com/gpu": 1, "vpc.amazonaws.com/efa": 1}
        assert env(group)["FI_PROVIDER"] == "efa"
        # IPC_LOCK is not effective for the image's non-root user: the nodes lift memlock (eksctl.py); EFA needs
        # no privilege either
        assert container(group)["securityContext"]["capabilities"] == {"drop": ["ALL"]}
        assert "privileged" not in container(group)["securityContext"]
        toleration = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
        assert toleration in group["template"]["spec"]["tolerations"]


def test_pools_without_efa_keep_ucx_and_set_no_libfabric_provider() -> None:
    rayservice = rayservice_of(render_manifests(defaults()))
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert "kv" not in args  # the default backends, UCX
    for role in ("prefill", "decode"):
        group = ray_groups(rayservice)[role]
        assert "FI_PROVIDER" not in env(group)
        assert set(container(group)["resources"]["limits"]) == {"cpu", "memory"}
        assert "tolerations" not in group["template"]["spec"]


def test_each_pool_lands_on_its_own_group_by_custom_resource_and_node_selector() -> None:
    settings = eks()
    rayservice = rayservice_of(render_manifests(settings))
    args = yaml.safe_load(rayservice["spec"]["serveConfigV2"])["applications"][0]["args"]
    groups = ray_groups(rayservice)
    for role in ("prefill", "decode"):
        assert groups[role]["rayStartParams"]["resources"] == f'"{{\\"{role}\\": 1}}"'
        assert args[role]["placement"]["resources"] == {role: 1.0}
        assert groups[role]["replicas"] == groups[role]["minReplicas"] == groups[role]["maxReplicas"] == 1
        assert groups[role]["template"]["spec"]["nodeSelector"] == {"node.kubernetes.io/instance-type": "g6.8xlarge"}
    assert groups["head"]["rayStartParams"] == {**PINNED_RAY_PORTS, "num-gpus": "0", "resources": '"{\\"head\\": 1}"'}
    assert groups["head"]["template"]["spec"]["nodeSelector"] == {"pdserve.io/node-role": "system"}
    assert args["ray"]["gateway_resources"] == {"head": 1.0} and args["gateway"]["host"] == "0.0.0.0"


def test_default_pools_get_a_custom_resource_only_their_group_offers() -> None:
    settings = kubernetes_settings(defaults())
    assert settings.prefill.placement.resources == {"prefill": 1.0}
    assert settings.decode.placement.resources == {"decode": 1.0}
    assert settings.ray.gateway_resources == {"head": 1.0}


def test_engines_reach_each_other_at_their_pod_ip(manifests: dict[str, dict[str, Any]]) -> None:
    for role in ("prefill", "decode"):
        group = ray_groups(manifests["RayService"])[role]
        assert env(group)["VLLM_HOST_IP"] == {"fieldRef": {"fieldPath": "status.podIP"}}
        _tmp, shm, _cache = group["template"]["spec"]["volumes"]
        assert shm == {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "16Gi"}}
        assert {"name": "dshm", "mountPath": "/dev/shm"} in container(group)["volumeMounts"]


def test_engine_pods_are_ready_when_their_engine_answers_not_on_serves_proxy(
    manifests: dict[str, dict[str, Any]],
) -> None:
    """KubeRay 1.6 probes a RayService worker without a probe of its own on :8000/-/healthz (Serve's proxy),
    which runs on the head only here (proxy_location HeadOnly): such a pod is never Ready."""
    assert yaml.safe_load(manifests["RayService"]["spec"]["serveConfigV2"])["proxy_location"] == "HeadOnly"
    for role in ("prefill", "decode"):
        probe = container(ray_groups(manifests["RayService"])[role])["readinessProbe"]
        assert probe["httpGet"] == {"path": "/health", "port": "vllm"}


def test_an_upgrade_never_starts_a_second_cluster_the_fixed_gpu_nodes_cannot_hold() -> None:
    rayservice = rayservice_of(render_manifests(eks()))
    assert rayservice["spec"]["upgradeStrategy"] == {"type": "None"}
    changed = rayservice_of(render_manifests(load_settings(EKS_EXAMPLE, overrides={"kubernetes.image": "pdserve:0.2.0"})))
    serve_only = rayservice_of(render_manifests(load_settings(EKS_EXAMPLE, overrides={"routing.disaggregation": "auto"})))
    hashes = [obj["metadata"]["annotations"]["pdserve.io/pods-hash"] for obj in (rayservice, changed, serve_only)]
    assert hashes[0] != hashes[1] and hashes[0] == hashes[2]  # cloud up replaces the RayService on pod changes


def test_with_new_cluster_upgrades_the_gateway_is_reached_through_kuberays_head_service() -> None:
    """KubeRay moves <name>-head-svc to a new cluster only once its Serve app runs; pdserve's own Service
    would select the new head as soon as it is Ready, before its engines exist."""
    settings = load_settings(EKS_EXAMPLE, overrides={"kubernetes.upgrade": "new_cluster"})
    objects = render_manifests(settings)
    assert rayservice_of(objects)["spec"]["upgradeStrategy"] == {"type": "NewCluster"}
    assert "Service" not in [obj["kind"] for obj in objects]
    head_ports = {port["name"] for port in container(ray_groups(rayservice_of(objects))["head"])["ports"]}
    assert "openai" in head_ports  # KubeRay's head Service carries every port of the head container


def test_several_gateway_replicas_get_a_worker_group_of_their_own_behind_the_service() -> None:
    objects = {obj["kind"]: obj for obj in reversed(render_manifests(
        load_settings(EKS_EXAMPLE, overrides={"gateway.replicas": 3})))}
    groups = ray_groups(objects["RayService"])
    gateway, head = groups["gateway"], groups["head"]
    assert (gateway["replicas"], gateway["minReplicas"], gateway["maxReplicas"]) == (3, 3, 3)
    offered = json.loads(json.loads(gateway["rayStartParams"]["resources"]))
    assert "resources" not in head["rayStartParams"]  # no replica on the head, outside the Service
    selector = objects["Service"]["spec"]["selector"]
    assert selector.items() <= gateway["template"]["metadata"]["labels"].items()
    assert not selector.items() <= head["template"]["metadata"]["labels"].items()
    probe = container(gateway)["readinessProbe"]
    assert probe["httpGet"] == {"path": "/health", "port": "openai"} and probe["failureThreshold"] == 1
    assert gateway["template"]["spec"]["nodeSelector"] == head["template"]["spec"]["nodeSelector"]
    args = yaml.safe_load(objects["RayService"]["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["gateway"]["replicas"] == 3 and args["ray"]["gateway_resources"] == offered  # what replicas ask for
    with pytest.raises(ConfigError, match="kubernetes.upgrade: recreate"):
        render_manifests(load_settings(EKS_EXAMPLE, overrides={"gateway.replicas": 2,
                                                               "kubernetes.upgrade": "new_cluster"}))


def test_engine_pods_keep_weights_and_compile_cache_on_the_node_and_may_read_a_hugging_face_token() -> None:
    group = ray_groups(rayservice_of(render_manifests(eks())))["decode"]
    pod = group["template"]["spec"]
    assert pod["volumes"][2] == {"name": "model-cache", "hostPath": {"path": "/var/lib/pdserve/cache",
                                                                     "type": "DirectoryOrCreate"}}
    assert env(group)["HF_HOME"] == "/mnt/pdserve-cache/huggingface"
    args = yaml.safe_load(rayservice_of(render_manifests(eks()))["spec"]["serveConfigV2"])["applications"][0]["args"]
    assert args["launch"]["cache_dir"] == "/mnt/pdserve-cache/vllm"  # vLLM's compiled model, beside the weights
    (owner,) = pod["initContainers"]
    # the image's user alone: 0700, and the init container is root with the two capabilities that takes only
    assert owner["command"] == ["sh", "-c", "chown 1000:100 /mnt/pdserve-cache && chmod 0700 /mnt/pdserve-cache"]
    assert owner["securityContext"]["runAsUser"] == 0
    assert owner["securityContext"]["capabilities"] == {"drop": ["ALL"], "add": ["CHOWN", "FOWNER"]}
    assert env(group)["HF_TOKEN"] == {"secretKeyRef": {"name": "pdserve-hf-token", "key": "token", "optional": True}}
    settings = eks()
    uncached = settings.model_copy(update={"kubernetes": settings.kubernetes.model_copy(update={"model_cache_path": ""})})
    bare = ray_groups(rayservice_of(render_manifests(uncached)))
    assert "initContainers" not in bare["decode"]["template"]["spec"] and "HF_HOME" not in env(bare["decode"])


def test_every_ray_container_carries_the_cluster_token(manifests: dict[str, dict[str, Any]]) -> None:
    spec = eks().kubernetes
    token = {"secretKeyRef": {"name": ray_token_secret_name(spec), "key": RAY_TOKEN_SECRET_KEY}}
    for group in ray_groups(manifests["RayService"]).values():
        assert env(group)["RAY_AUTH_MODE"] == "token" and env(group)["RAY_AUTH_TOKEN"] == token
    auth = manifests["RayService"]["spec"]["rayClusterConfig"]["authOptions"]
    assert auth == {"mode": "token", "secretName": "pdserve-ray-token"}


def secret_refs(group: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The container's variables that come from a Secret, by name."""
    return {name: value["secretKeyRef"] for name, value in env(group).items()
            if isinstance(value, dict) and "secretKeyRef" in value}


def test_the_pods_require_their_secrets_and_only_the_hugging_face_token_is_optional(
    manifests: dict[str, dict[str, Any]],
) -> None:
    """A missing Secret keeps the pod from starting (CreateContainerConfigError) rather than starting it open."""
    groups = ray_groups(manifests["RayService"])
    assert secret_refs(groups["head"]) == {
        "RAY_AUTH_TOKEN": {"name": "pdserve-ray-token", "key": "auth_token"},
        "PDSERVE_API_KEYS": {"name": "pdserve-api-keys", "key": "api_keys"},
        "PDSERVE_ADMIN_KEY": {"name": "pdserve-api-keys", "key": "admin_key"},
        "PDSERVE_ENGINE_KEY": {"name": "pdserve-engine-key", "key": "engine_key"},
    }
    for role in ("prefill", "decode"):  # engines: the engine key, never the gateway's keys
        assert secret_refs(groups[role]) == {
            "RAY_AUTH_TOKEN": {"name": "pdserve-ray-token", "key": "auth_token"},
            "PDSERVE_ENGINE_KEY": {"name": "pdserve-engine-key", "key": "engine_key"},
            "HF_TOKEN": {"name": "pdserve-hf-token", "key": "token", "optional": True},
        }


def test_with_several_gateways_the_keys_go_to_the_gateway_pods_and_not_the_head() -> None:
    groups = ray_groups(rayservice_of(render_manifests(load_settings(EKS_EXAMPLE, overrides={"gateway.replicas": 2}))))
    assert set(secret_refs(groups["gateway"])) == {"RAY_AUTH_TOKEN", "PDSERVE_API_KEYS", "PDSERVE_ADMIN_KEY",
                                                   "PDSERVE_ENGINE_KEY"}
    assert set(secret_refs(groups["head"])) == {"RAY_AUTH_TOKEN"}


def test_an_open_gateway_reads_keys_from_an_optional_secret_and_its_metrics_without_one() -> None:
    """access.open: true says in words that no key is needed; the engine key stays required."""
    objects = render_manifests(load_settings(EKS_EXAMPLE, overrides={"access.open": True}))
    refs = secret_refs(ray_groups(rayservice_of(objects))["head"])
    assert refs["PDSERVE_API_KEYS"]["optional"] is True and refs["PDSERVE_ADMIN_KEY"]["optional"] is True
    assert "optional" not in refs["PDSERVE_ENGINE_KEY"]
    monitors = {obj["metadata"]["name"]: obj for obj in objects if obj["kind"] == "PodMonitor"}
    assert "authorization" not in monitors["pdserve-gateway"]["spec"]["podMetricsEndpoints"][0]
    assert "authorization" in monitors["pdserve-engines"]["spec"]["podMetricsEndpoints"][0]


def all_pod_specs(settings: Settings) -> dict[str, dict[str, Any]]:
    """Every pod spec pdserve renders for ``settings``: each Ray group's and `cloud up`'s image check pod."""
    groups = ray_groups(rayservice_of(render_manifests(settings)))
    return {name: group["template"]["spec"] for name, group in groups.items()} | {
        "image-check": image_check_pod(settings)["spec"]}


@pytest.mark.parametrize("config", [*CONFIGS, "several-gateways"])
def test_every_container_runs_unprivileged_with_a_read_only_root(config: str) -> None:
    settings = (load_settings(EKS_EXAMPLE, overrides={"gateway.replicas": 2}) if config == "several-gateways"
                else CONFIGS[config]())
    for name, pod in all_pod_specs(settings).items():
        assert pod["automountServiceAccountToken"] is False, name  # no pod calls the Kubernetes API
        assert pod["securityContext"]["runAsNonRoot"] is True and pod["securityContext"]["runAsUser"] == 1000, name
        for box in [*pod["containers"], *pod.get("initContainers", [])]:
            security = box["securityContext"]
            assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True, name
            assert security["capabilities"]["drop"] == ["ALL"] and "privileged" not in security, name
            is_root = security.get("runAsUser") == 0
            assert is_root == (box["name"] == "cache-owner"), name  # root only to hand the node's cache over
            assert security["capabilities"].get("add", []) == (["CHOWN", "FOWNER"] if is_root else []), name


def written_paths(settings: Settings, box: dict[str, Any], *, is_engine: bool) -> list[str]:
    """Where a Ray container is told to write: HOME and HF_HOME, the logs the Serve config names and, where an
    engine runs, its compile cache."""
    variables = {var["name"]: var.get("value") for var in box["env"]}
    args = yaml.safe_load(rayservice_of(render_manifests(settings))["spec"]["serveConfigV2"])["applications"][0]["args"]
    launch = args["launch"]
    cache = [launch["cache_dir"]] if is_engine and "cache_dir" in launch else []
    return [variables["HOME"], *([variables["HF_HOME"]] if "HF_HOME" in variables else []), launch["log_dir"], *cache]


@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_path_a_ray_container_writes_is_on_a_volume_it_mounts(config: str) -> None:
    """The root filesystem is read-only: HOME (~/.cache and the like), Ray's /tmp/ray, the engine logs and the
    caches must each be on a mounted volume."""
    settings = CONFIGS[config]()
    for name, group in ray_groups(rayservice_of(render_manifests(settings))).items():
        box = container(group)
        mounts = [mount["mountPath"] for mount in box["volumeMounts"]]
        for path in [*written_paths(settings, box, is_engine=name in {"prefill", "decode"}), "/tmp/ray"]:
            assert any(Path(path).is_relative_to(mount) for mount in mounts), (name, path)
        volumes = {volume["name"] for volume in group["template"]["spec"]["volumes"]}
        assert {mount["name"] for mount in box["volumeMounts"]} <= volumes, name


def test_a_log_or_cache_dir_on_the_read_only_root_is_a_config_error() -> None:
    for field in ("launch.log_dir", "launch.cache_dir"):
        with pytest.raises(ConfigError, match=field.replace(".", r"\.") + ": /var/log/pdserve is on the pods' read-only"):
            render_manifests(load_settings(EKS_EXAMPLE, overrides={field: "/var/log/pdserve"}))
    render_manifests(load_settings(EKS_EXAMPLE, overrides={"launch.log_dir": "/tmp/engines"}))


def test_the_default_image_is_this_release_never_latest() -> None:
    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    assert KubernetesSpec().image == f"pdserve:{version}"


def test_a_gateway_port_ray_uses_on_the_head_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match=r"gateway\.port: 8000 is Ray's serve port"):
        render_manifests(load_settings(None))


def test_efa_on_one_pool_only_is_a_config_error() -> None:
    settings = load_settings(EKS_EXAMPLE, overrides={"decode.placement.efa_devices": 0})
    with pytest.raises(ConfigError, match=r"prefill\.placement\.efa_devices"):
        render_manifests(settings)


def test_ray_resources_param_is_quoted_for_kuberay() -> None:
    assert ray_resources_param({"prefill": 1.0, "big": 0.5}) == '"{\\"big\\": 0.5, \\"prefill\\": 1}"'
    assert json.loads(json.loads(ray_resources_param({"prefill": 1.0}))) == {"prefill": 1}


def test_render_yaml_matches_the_golden_file() -> None:
    rendered = render_yaml(eks())
    if os.environ.get("PDSERVE_UPDATE_GOLDEN") == "1":
        GOLDEN.write_text(rendered)
    assert rendered == GOLDEN.read_text(), "rendered manifests changed: PDSERVE_UPDATE_GOLDEN=1 to accept"
    assert list(yaml.safe_load_all(rendered)) == render_manifests(eks())


def test_write_manifests_writes_one_file_per_object_in_apply_order(tmp_path: Path) -> None:
    paths = write_manifests(eks(), tmp_path / "out")
    assert [path.name for path in paths] == ["00-namespace.yaml", *["10-networkpolicies.yaml"] * 7,
                                              "20-rayservice.yaml", "30-service.yaml", "40-podmonitor.yaml",
                                              "50-podmonitor.yaml", "60-configmap.yaml"]
    files = sorted(set(paths))
    assert [obj for path in files for obj in yaml.safe_load_all(path.read_text())] == render_manifests(eks())
    assert files[0].read_text().startswith(secrets_comment(eks()))


def test_no_pod_monitor_or_dashboard_when_turned_off() -> None:
    settings = load_settings(EKS_EXAMPLE, overrides={"kubernetes.pod_monitor": False,
                                                     "kubernetes.grafana_dashboard": False})
    assert [obj["kind"] for obj in render_manifests(settings)] == ["Namespace", *["NetworkPolicy"] * 7,
                                                                    "RayService", "Service"]


def test_render_k8s_writes_files_and_prints_kubectl_style_lines(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["render", "k8s", "--config", str(EKS_EXAMPLE), "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    policies = [f"networkpolicy.networking.k8s.io/pdserve-{name} rendered to {tmp_path}/10-networkpolicies.yaml"
                for name in ("default-deny", "gateway", "head", "ray", "prefill", "decode", "kv")]
    assert result.output.splitlines() == [
        f"namespace/pdserve rendered to {tmp_path}/00-namespace.yaml",
        *policies,
        f"rayservice.ray.io/pdserve rendered to {tmp_path}/20-rayservice.yaml",
        f"service/pdserve-gateway rendered to {tmp_path}/30-service.yaml",
        f"podmonitor.monitoring.coreos.com/pdserve-gateway rendered to {tmp_path}/40-podmonitor.yaml",
        f"podmonitor.monitoring.coreos.com/pdserve-engines rendered to {tmp_path}/50-podmonitor.yaml",
        f"configmap/pdserve-grafana-dashboard rendered to {tmp_path}/60-configmap.yaml",
        *secrets_note(eks()),
    ]


def test_render_k8s_names_each_required_secret_and_the_command_that_makes_it() -> None:
    rendered = render_yaml(eks())
    comment = rendered[:rendered.index("apiVersion")]
    for name, keys in (("pdserve-ray-token", ["auth_token"]), ("pdserve-engine-key", ["engine_key"]),
                       ("pdserve-api-keys", ["api_keys", "admin_key"])):
        (command,) = [line for line in comment.splitlines() if f"create secret generic {name} " in line]
        assert command.startswith("#     kubectl -n pdserve create secret generic")
        assert [literal.split("=")[0] for literal in command.split("--from-literal=")[1:]] == keys
    opened = render_yaml(load_settings(EKS_EXAMPLE, overrides={"access.open": True}))
    assert "pdserve-api-keys" not in opened[:opened.index("apiVersion")]


def test_render_k8s_without_out_prints_the_yaml_stream() -> None:
    result = CliRunner().invoke(app, ["render", "k8s", "--config", str(EKS_EXAMPLE)])
    assert result.exit_code == 0 and result.output == render_yaml(eks())


def test_render_k8s_with_a_clashing_port_exits_2_naming_the_field() -> None:
    result = CliRunner().invoke(app, ["render", "k8s"])
    assert result.exit_code == 2 and "gateway.port" in result.output


def test_render_serve_prints_the_serve_config() -> None:
    result = CliRunner().invoke(app, ["render", "serve", "--config", str(EKS_EXAMPLE)])
    assert result.exit_code == 0 and yaml.safe_load(result.output) == serve_config(eks())


def documented_ingress() -> dict[str, Any]:
    """The Ingress docs/deploy.md ("TLS") gives for terminating TLS at an ALB."""
    text = (REPO / "docs" / "deploy.md").read_text().split("**On Kubernetes, at an Ingress.**", 1)[1]
    ingress: dict[str, Any] = yaml.safe_load(text.split("```yaml\n", 1)[1].split("```", 1)[0])
    return ingress


def test_the_documented_tls_ingress_is_valid_and_reaches_the_rendered_gateway_service() -> None:
    ingress = documented_ingress()
    kubernetes_validate.validate(ingress, eks().eks.kubernetes_version + ".0", strict=True)
    service = next(obj for obj in render_manifests(eks()) if obj["kind"] == "Service")
    assert ingress["metadata"]["namespace"] == service["metadata"]["namespace"]
    (path,) = ingress["spec"]["rules"][0]["http"]["paths"]
    assert path["backend"]["service"] == {"name": service["metadata"]["name"],
                                          "port": {"name": service["spec"]["ports"][0]["name"]}}
    annotations = ingress["metadata"]["annotations"]
    assert json.loads(annotations["alb.ingress.kubernetes.io/listen-ports"]) == [{"HTTPS": 443}]  # HTTPS only
    assert annotations["alb.ingress.kubernetes.io/target-type"] == "ip"  # a ClusterIP Service has no node port
    # the ALB's health check needs no key: /health/ready answers anyone (gateway/app.py)
    assert annotations["alb.ingress.kubernetes.io/healthcheck-path"] == "/health/ready"

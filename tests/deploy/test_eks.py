"""``pdserve cloud up|status|down`` through the real code path, against stand-in eksctl, kubectl,
helm and aws executables that record every call and keep what they "created" (eks_standins.py)."""

from __future__ import annotations

import json
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from pdserve.cli import app
from pdserve.deploy import eksctl, runner

STANDINS = Path(__file__).with_name("eks_standins.py")
TOOLS = ("aws", "eksctl", "helm", "kubectl")
CONFIG = """
prefill:
  device: cuda
  gpu_ids: [0]
  placement: {node_labels: {pdserve.io/node-role: gpu}, efa_devices: 1}
decode:
  device: cuda
  gpu_ids: [0]
  placement: {node_labels: {pdserve.io/node-role: gpu}, efa_devices: 1}
gateway: {port: 9000}
kubernetes: {name: pdserve, namespace: serving}
eks: {cluster_name: demo, region: us-west-2, gpu_nodes: 2}
"""
PREFLIGHT_STEPS = ["eksctl-version", "kubectl-version", "helm-version", "aws-identity", "instance-types",
                   "quota-L-DB2E81BA", "quota-L-DB2E81BA-default", "quota-L-1216C47A", "quota-L-1216C47A-default", "zones"]
UP_STEPS = ["cluster-stack", "cluster", "system-stack", "system-nodes", "gpu-stack", "gpu-nodes", "kubeconfig", "efa-device-plugin", "gpu-nodes-ready",
            "image-check-clean", "image-check-pod", "image-ray-version", "image-check-done", "helm-repo",
            "kuberay-operator", "namespace", "ray-token", "engine-key", "api-keys", "replace-pods", "manifests",
            "pod-monitor", "serving"]
DOWN_STEPS = ["kubeconfig", "pod-monitor", "manifests", "ray-token", "kuberay-operator", "cluster", "kube-context"]
STACKS = "aws cloudformation describe-stacks"  # a failed create's stack, looked for before each create
# the commands `up` runs (checks left out), by their leading words without --context; each poll is one
# command: the GPU nodes are NotReady and tainted at the first look, the check pod is pulling at its first, and
# the Serve app waits for KubeRay's workers (wait-gcs-ready), then deploys, then runs
UP_COMMANDS = [
    "eksctl version", "kubectl version --client --output json", "helm version --short", "aws sts get-caller-identity",
    "aws ec2 describe-instance-types",
    # per quota: the account's value (looked for, then read), then AWS's default
    *["aws service-quotas get-service-quota"] * 2, "aws service-quotas get-aws-default-service-quota",
    *["aws service-quotas get-service-quota"] * 2, "aws service-quotas get-aws-default-service-quota",
    "aws ec2 describe-instance-type-offerings",
    *[STACKS, "eksctl create cluster", STACKS, "eksctl create nodegroup -f - --include system", STACKS,
      "eksctl create nodegroup -f - --include gpu"], "aws eks update-kubeconfig",
    "kubectl patch --namespace kube-system daemonset aws-efa-k8s-device-plugin --type merge",
    *["kubectl get nodes,daemonsets,pods --namespace kube-system"] * 2, "kubectl create -f -",
    *["kubectl get pod pdserve-image-check --namespace default -o json"] * 2,
    "kubectl delete pod pdserve-image-check --namespace default", "helm repo add",
    "helm upgrade --install", "kubectl apply", *["kubectl create secret"] * 3, "kubectl apply",
    *["kubectl get rayservices,pods,events,nodes"] * 3,
]
POLLS = ("get nodes,daemonsets,pods", "get rayservices,pods,events,nodes",
         "get pod pdserve-image-check --namespace default -o json")
MAX_SLEEPS = 20  # a poll that would go on waiting fails the test instead of spinning
CHECKS = ("get", "status", "get-contexts")


@dataclass(frozen=True)
class Standins:
    bin_dir: Path
    log: Path
    config: Path
    sleeps_s: list[float] = field(default_factory=list)  # the runner's waits between polls, none taken

    def calls(self) -> list[dict[str, Any]]:
        if not self.log.exists():
            return []
        return [json.loads(line) for line in self.log.read_text().splitlines()]

    def commands(self) -> list[str]:
        """Every call but the existence checks, as 'tool words...'."""
        return [" ".join([call["tool"], *call["words"]]) for call in self.calls()
                if not _is_check(call["tool"], call["words"])]

    def forget_calls(self) -> None:
        self.log.unlink(missing_ok=True)
        self.sleeps_s.clear()

    def polls(self, words: str) -> int:
        return sum(" ".join(call["words"]).startswith(words) for call in self.calls())

    def sleep(self, seconds: float) -> None:
        """The runner's sleep between polls: counted, not slept (the stand-ins' time is their count of reads)."""
        self.sleeps_s.append(seconds)
        assert len(self.sleeps_s) <= MAX_SLEEPS, "a poll kept waiting"


def _is_check(tool: str, words: list[str]) -> bool:
    if tool == "kubectl" and " ".join(words).startswith(POLLS):
        return False  # the waits for the GPU nodes, the image and the app: steps of their own
    return (words[0] in CHECKS or words[:2] == ["config", "get-contexts"]) and tool != "aws"


@pytest.fixture
def standins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Standins:
    """The four tools, and nothing else, on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in TOOLS:
        wrapper = bin_dir / tool
        wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" "{STANDINS}" {tool} "$@"\n')
        wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setenv("STANDIN_LOG", str(tmp_path / "calls.jsonl"))
    monkeypatch.setenv("STANDIN_STATE", str(tmp_path / "state.json"))
    monkeypatch.delenv("STANDIN_FAIL", raising=False)
    config = tmp_path / "eks.yaml"
    config.write_text(CONFIG)
    found = Standins(bin_dir=bin_dir, log=tmp_path / "calls.jsonl", config=config)
    monkeypatch.setattr(runner, "time", SimpleNamespace(monotonic=time.monotonic, sleep=found.sleep))
    return found


def cloud(standins: Standins, *args: str) -> Result:
    return CliRunner().invoke(app, ["cloud", *args, "--config", str(standins.config)])


def stopped_up(standins: Standins) -> Result:
    """``cloud up`` that must stop with an error."""
    result = cloud(standins, "up")
    assert result.exit_code == 1, result.output
    return result


def applied_nothing(standins: Standins) -> bool:
    """No manifest applied and no Helm release made: the plan stopped before the cluster was changed."""
    return not [command for command in standins.commands() if command.startswith(("kubectl apply", "helm repo", "helm upgrade"))]


def step_lines(output: str) -> dict[str, list[str]]:
    """Step name -> its progress lines ('[3/12] name  ...')."""
    lines: dict[str, list[str]] = {}
    for match in re.finditer(r"^\[ *\d+/\d+\] (\S+) +(.*)$", output, flags=re.MULTILINE):
        lines.setdefault(match.group(1), []).append(match.group(2))
    return lines


def test_up_dry_run_prints_every_command_and_manifest_in_order_and_calls_no_tool(standins: Standins) -> None:
    result = cloud(standins, "up", "--dry-run")
    assert result.exit_code == 0, result.output
    assert list(step_lines(result.output)) == PREFLIGHT_STEPS + UP_STEPS
    assert re.findall(r"^\[ *(\d+)/23\]", result.output, flags=re.MULTILINE) == [str(n) for n in range(1, 24)]
    assert "aws ec2 describe-instance-type-offerings" in result.output
    for content in ("kind: ClusterConfig", "efaEnabled: true", "kind: NetworkPolicy", "kind: RayService", "kind: Service",
                    "kind: PodMonitor", "helm upgrade --install kuberay-operator kuberay/kuberay-operator"):
        assert content in result.output
    assert "stdin: (secret, not shown)" in result.output
    assert standins.calls() == []


def test_up_applies_both_pod_monitors_where_their_crd_is_and_the_dashboard_with_the_manifests(
    standins: Standins,
) -> None:
    result = cloud(standins, "up", "--dry-run")
    assert result.exit_code == 0, result.output
    pod_monitor_step = result.output.split("] pod-monitor")[1].split("] serving")[0]
    manifests_step = result.output.split("] manifests")[1].split("] pod-monitor")[0]
    assert "name: pdserve-gateway" in pod_monitor_step and "name: pdserve-engines" in pod_monitor_step
    assert "kind: PodMonitor" not in manifests_step and "kind: ConfigMap" in manifests_step


def test_down_dry_run_prints_the_plan_in_reverse_and_calls_no_tool(standins: Standins) -> None:
    result = cloud(standins, "down", "--dry-run")
    assert result.exit_code == 0, result.output
    assert list(step_lines(result.output)) == DOWN_STEPS
    assert "eksctl delete cluster --name demo --region us-west-2 --wait" in result.output
    assert standins.calls() == []


def test_up_runs_the_tools_in_order_and_says_how_to_reach_the_app(standins: Standins) -> None:
    result = cloud(standins, "up")
    assert result.exit_code == 0, result.output
    commands = standins.commands()
    assert len(commands) == len(UP_COMMANDS)
    for command, expected in zip(commands, UP_COMMANDS, strict=True):
        assert command.startswith(expected), (command, expected)
    cluster_config = next(call["stdin"] for call in standins.calls() if call["words"][:2] == ["create", "cluster"])
    # subnets in both zones offering g6 (the GPU group may move), the group in the first
    assert "availabilityZones:\n- us-west-2b\n- us-west-2d\n" in cluster_config
    assert "  availabilityZones:\n  - us-west-2b\n  labels" in cluster_config
    assert "skipped (nothing to do)" in step_lines(result.output)["pod-monitor"][0]  # no Prometheus Operator
    assert "port-forward svc/pdserve-gateway --namespace serving 9000:openai" in result.output


def test_the_keys_reach_kubectl_through_stdin_only_and_only_the_api_key_is_shown_once(standins: Standins) -> None:
    result = cloud(standins, "up")
    assert result.exit_code == 0, result.output
    made = {call["words"][3]: call["stdin"] for call in standins.calls() if call["words"][:2] == ["create", "secret"]}
    assert list(made) == ["pdserve-ray-token", "pdserve-engine-key", "pdserve-api-keys"]
    api_keys = dict(line.split("=", 1) for line in made["pdserve-api-keys"].splitlines())
    shown = [made["pdserve-ray-token"], made["pdserve-engine-key"], api_keys["admin_key"]]
    assert all(len(key) >= 40 and key not in result.output for key in shown)
    assert result.output.count(api_keys["api_keys"]) == 1  # shown once, with how to read it back
    assert ("kubectl -n serving get secret pdserve-api-keys -o jsonpath='{.data.api_keys}' | base64 -d"
            in result.output)
    for key in [*shown, api_keys["api_keys"]]:
        assert all(key not in " ".join(call["argv"]) for call in standins.calls())

    standins.forget_calls()
    again = cloud(standins, "up")  # the Secrets exist: none is made, no key shown
    assert again.exit_code == 0, again.output
    assert not [call for call in standins.calls() if call["words"][:2] == ["create", "secret"]]
    assert api_keys["api_keys"] not in again.output and "shown once" not in again.output


def test_a_failed_step_stops_the_plan_with_its_error_and_a_rerun_resumes(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_FAIL", "helm upgrade")
    failed = cloud(standins, "up")
    assert failed.exit_code == 1
    assert "step kuberay-operator failed (exit 1): helm upgrade --install" in failed.stderr
    assert "simulated failure of helm upgrade" in failed.stderr
    assert standins.commands()[-2].startswith("helm upgrade"), "nothing runs after the failed step"
    assert standins.commands()[-1].startswith(STACKS), "but the look at what still bills"

    monkeypatch.delenv("STANDIN_FAIL")
    standins.forget_calls()
    resumed = cloud(standins, "up")
    assert resumed.exit_code == 0, resumed.output
    steps = step_lines(resumed.output)
    for done in ("cluster", "system-nodes", "gpu-nodes"):
        assert steps[done] == ["skipped (already done)"]
    assert not [command for command in standins.commands() if command.startswith("eksctl create")]
    assert any(command.startswith("helm upgrade --install") for command in standins.commands())


def test_down_runs_in_reverse_and_a_second_down_has_nothing_left_to_do(standins: Standins) -> None:
    assert cloud(standins, "up").exit_code == 0
    standins.forget_calls()
    down = cloud(standins, "down")
    assert down.exit_code == 0, down.output
    removals = [command for command in standins.commands() if command.split()[1] in ("delete", "uninstall", "config")]
    assert [" ".join(command.split()[:3]) for command in removals] == [
        "kubectl delete -f", "helm uninstall kuberay-operator", "eksctl delete cluster", "kubectl config delete-context"]
    assert step_lines(down.output)["ray-token"] == ["skipped (nothing to do)"]  # went with the namespace

    standins.forget_calls()
    again = cloud(standins, "down")
    assert again.exit_code == 0, again.output
    assert all(lines == ["skipped (nothing to do)"] for lines in step_lines(again.output).values())


def test_missing_tools_are_named_with_where_to_get_them_before_anything_runs(standins: Standins) -> None:
    (standins.bin_dir / "eksctl").unlink()
    (standins.bin_dir / "helm").unlink()
    result = cloud(standins, "up")
    assert result.exit_code == 1
    assert "eksctl: not on PATH; install it from https://eksctl.io/installation/" in result.stderr
    assert "helm: not on PATH; install it from https://helm.sh/docs/intro/install/" in result.stderr
    assert "kubectl" not in result.stderr
    assert standins.calls() == []

    dry_run = cloud(standins, "down", "--dry-run")
    assert dry_run.exit_code == 0
    assert "warning:" in dry_run.output and "eksctl: not on PATH" in dry_run.output


def test_status_shows_pods_on_nodes_gpu_and_efa_the_app_and_gateway_checks(standins: Standins) -> None:
    assert cloud(standins, "up").exit_code == 0
    result = cloud(standins, "status")
    assert result.exit_code == 0, result.output
    assert re.search(r"pdserve-raycluster-prefill-worker-0\s+1/1\s+Running\s+0\s+ip-10-0-1-5\s+10\.0\.1\.101",
                     result.output)
    assert re.search(r"ip-10-0-1-5\s+g6\.8xlarge\s+us-west-2b\s+Ready\s+1\s+1", result.output)
    assert re.search(r"pdserve\s+RUNNING \(prefill HEALTHY, decode HEALTHY, gateway HEALTHY\)", result.output)
    assert re.search(r"pd==local\s+OK\s+3 greedy tokens identical", result.output)
    # the 12 transfers before, and pd==local's PD request: Qwen3.5-9B's state and 100 tokens x 32,768 bytes
    assert re.search(r"kv-transfers\s+OK\s+http://10\.0\.3\.7:8200: 13 transfers, 454\.8 MB at 2\.08 GB/s",
                     result.output)
    assert re.search(r"engine-probe\s+SKIPPED", result.output)
    forward = [call for call in standins.calls() if call["words"][:1] == ["port-forward"]]
    assert forward and forward[0]["words"][-1] == ":openai"


def test_status_before_up_fails_naming_what_is_missing(standins: Standins) -> None:
    result = cloud(standins, "status")
    assert result.exit_code == 1
    assert "RayService pdserve failed" in result.stderr and "not found" in result.stderr


def test_up_dry_run_shows_the_preflight_the_memlock_bootstrap_the_efa_plugin_and_the_engine_readiness_probe(
    standins: Standins,
) -> None:
    result = cloud(standins, "up", "--dry-run")
    assert result.exit_code == 0, result.output
    steps = result.output.split("] gpu-nodes-ready")[1]
    assert "preflight: each of the 2 GPU nodes offers 1 nvidia.com/gpu and 1 vpc.amazonaws.com/efa" in steps
    assert "preflight: the image's Ray is kubernetes.ray_version 2.60.0" in steps
    cluster = result.output.split("] cluster  ")[1].split("] system-nodes")[0]
    assert "overrideBootstrapCommand: |" in cluster and "type: RLIMIT_MEMLOCK" in cluster
    assert "patch --namespace kube-system daemonset aws-efa-k8s-device-plugin --type merge" in result.output
    manifests = result.output.split("] manifests")[1].split("] pod-monitor")[0]
    assert manifests.count("readinessProbe:") == 2 and "path: /health" in manifests


def test_the_efa_plugin_is_patched_by_its_real_name_so_every_gpu_node_offers_efa_and_the_engines_run(
    standins: Standins,
) -> None:
    result = cloud(standins, "up")
    assert result.exit_code == 0, result.output
    assert "ready: 2 GPU nodes, each with 1 nvidia.com/gpu and 1 vpc.amazonaws.com/efa" in result.output
    status = cloud(standins, "status")
    assert re.search(r"ip-10-0-1-6\s+g6\.8xlarge\s+us-west-2b\s+Ready\s+1\s+1", status.output)
    # engine pods are Ready once their engine answers, not on Serve's proxy (which runs on the head only)
    for role in ("prefill", "decode"):
        assert re.search(rf"pdserve-raycluster-{role}-worker-0\s+1/1\s+Running", status.output), status.output


def test_gpu_nodes_the_efa_plugin_never_runs_on_stop_up_at_the_first_poll_with_the_cause_and_its_fix(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An eksctl whose EFA plugin manifest predates the instance type: no GPU node ever offers EFA."""
    monkeypatch.setenv("STANDIN_EFA_TYPES", "g5.8xlarge,p5.48xlarge")
    result = stopped_up(standins)
    assert standins.polls("get nodes,daemonsets,pods") == 1 and standins.sleeps_s == [], "stopped at the first look"
    assert "FailedScheduling: Insufficient vpc.amazonaws.com/efa" in result.stderr
    assert "node affinity leaves out node ip-10-0-1-5 (g6.8xlarge)" in result.stderr
    assert "pick an EFA instance type (eks.gpu_instance_type)" in result.stderr
    assert applied_nothing(standins)


def test_pods_that_no_node_can_take_stop_the_wait_at_the_first_poll_with_the_scheduler_words_and_a_fix(
    standins: Standins,
) -> None:
    standins.config.write_text(CONFIG.replace("efa_devices: 1}", "efa_devices: 1, memory_gib: 200}"))
    result = stopped_up(standins)
    assert standins.polls("get rayservices,pods,events,nodes") == 1
    assert ("pod pdserve-raycluster-prefill-worker-0: Pending: 0/3 nodes are available: 1 node(s) didn't match Pod's "
            "node affinity/selector, 2 Insufficient memory.") in result.stderr
    assert "the pod requests 200.0Gi of memory but its nodes offer at most 120.0Gi" in result.stderr


def test_an_image_carrying_another_ray_stops_up_before_anything_is_applied(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_IMAGE_RAY_VERSION", "2.54.0")
    assert "has Ray 2.54.0, but kubernetes.ray_version is 2.60.0" in stopped_up(standins).stderr
    assert applied_nothing(standins)


def test_a_change_of_the_pods_replaces_the_rayservice_and_a_change_of_serve_config_alone_does_not(
    standins: Standins,
) -> None:
    """KubeRay's upgradeStrategy None applies a new Serve config in place but never a new pod spec."""
    assert cloud(standins, "up").exit_code == 0
    serve_change = CONFIG + "routing: {disaggregation: auto}\n"
    pods_change = serve_change.replace("namespace: serving}", "namespace: serving, image: 'pdserve:0.2.0'}")
    for config, is_replaced in ((CONFIG, False), (serve_change, False), (pods_change, True)):
        standins.config.write_text(config)
        standins.forget_calls()
        result = cloud(standins, "up")
        assert result.exit_code == 0, result.output
        replaced = [command for command in standins.commands() if command.startswith("kubectl delete rayservice")]
        assert bool(replaced) is is_replaced, step_lines(result.output)["replace-pods"]


ECR_IMAGE = "123456789012.dkr.ecr.us-west-2.amazonaws.com/pdserve:0.1.0"


@pytest.mark.parametrize(("pull", "reason", "message"), [
    ("not-found", "ErrImagePull", (f'rpc error: code = NotFound desc = failed to pull and unpack image "{ECR_IMAGE}": '
                                  f'failed to resolve reference "{ECR_IMAGE}": {ECR_IMAGE}: not found')),
    ("unauthorized", "ErrImagePull", ("unexpected status from HEAD request to https://123456789012.dkr.ecr.us-west-2."
                                     "amazonaws.com/v2/pdserve/manifests/0.1.0: 403 Forbidden")),
    ("bad-name", "InvalidImageName", (f'Failed to apply default image tag "{ECR_IMAGE}": couldn\'t parse image name '
                                     f'"{ECR_IMAGE}": invalid reference format')),
])
def test_an_image_that_cannot_be_pulled_stops_up_at_the_first_pull_error_with_the_kubelets_reason(
    standins: Standins, monkeypatch: pytest.MonkeyPatch, pull: str, reason: str, message: str,
) -> None:
    """Not 20 minutes of `kubectl run --pod-running-timeout`: the look after the pull failed stops the plan. The
    image is in ECR (the preflight's describe-images finds it); its pull on the node still fails."""
    monkeypatch.setenv("STANDIN_IMAGE_PULL", pull)
    monkeypatch.setenv("STANDIN_ECR_IMAGES", "pdserve:0.1.0")
    standins.config.write_text(CONFIG.replace("namespace: serving}", f"namespace: serving, image: '{ECR_IMAGE}'}}"))
    result = stopped_up(standins)
    assert f"step image-ray-version: the image {ECR_IMAGE} cannot be pulled: {reason}: " in result.stderr
    assert message in result.stderr
    assert "fix: the node cannot pull kubernetes.image" in result.stderr
    # InvalidImageName is refused before any pull; a pull shows ContainerCreating once, then its failure
    polls = 1 if reason == "InvalidImageName" else 2
    assert standins.polls(POLLS[2]) == polls
    assert len(standins.sleeps_s) == 1 + (polls - 1)  # one wait for the GPU nodes, none after the failure
    assert applied_nothing(standins)


def test_a_rerun_replaces_the_check_pod_an_interrupted_run_left(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_IMAGE_PULL", "not-found")
    stopped_up(standins)  # the pod stays, in ImagePullBackOff, for `kubectl describe`
    monkeypatch.delenv("STANDIN_IMAGE_PULL")  # the image was pushed
    standins.forget_calls()
    result = cloud(standins, "up")
    assert result.exit_code == 0, result.output
    assert step_lines(result.output)["image-check-clean"][0].startswith("running: kubectl --context")
    assert "ready: the image carries Ray 2.60.0" in result.output
    assert standins.commands().count("kubectl delete pod pdserve-image-check --namespace default --ignore-not-found "
                                     "--wait=true") == 2  # the old pod first, the new one after


def test_an_image_without_ray_fails_the_check_with_its_traceback(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("STANDIN_IMAGE_RAY_VERSION", "")
    result = stopped_up(standins)
    assert "could not run `python -c" in result.stderr and "exit 1 (Error)" in result.stderr
    assert "ModuleNotFoundError: No module named 'ray'" in result.stderr


def test_gpu_nodes_that_come_up_tainted_and_not_ready_are_waited_for_not_a_blocker(standins: Standins) -> None:
    """A new node carries not-ready and the cloud provider's uninitialized taint until it is Ready, and the EFA
    plugin's pods (whatever the DaemonSet controller adds) tolerate neither: a wait, never "never runs"."""
    result = cloud(standins, "up")
    assert result.exit_code == 0, result.output
    waited, ready = step_lines(result.output)["gpu-nodes-ready"][1:3]
    assert waited.startswith("waiting") and ("ip-10-0-1-5 is coming up (Ready=False, tainted "
                                             "node.kubernetes.io/not-ready:NoSchedule, "
                                             "node.cloudprovider.kubernetes.io/uninitialized:NoSchedule)") in waited
    assert "EFA device plugin on ip-10-0-1-5: no pod yet" in waited
    assert ready.startswith("ready: 2 GPU nodes")
    assert standins.polls("get nodes,daemonsets,pods") == 2


def test_the_serve_app_is_waited_for_through_kuberays_init_container_and_deploying(standins: Standins) -> None:
    result = cloud(standins, "up")
    assert result.exit_code == 0, result.output
    first, second = [line for line in step_lines(result.output)["serving"] if line.startswith("waiting")]
    assert "app pdserve DEPLOYING (prefill UPDATING, decode UPDATING, gateway UPDATING)" in first
    assert "app pdserve DEPLOYING" in second
    assert standins.polls("get rayservices,pods,events,nodes") == 3


def test_the_engines_read_a_memlock_they_can_pin_after_nodeadm_containerd_and_cpython(standins: Standins) -> None:
    """The stand-in takes the NodeConfig's memlock through nodeadm's float64 merge, containerd's uint64 and
    CPython's signed rlimit; the engines' preflight refuses a negative one and Serve gives up on them."""
    result = cloud(standins, "up")
    assert result.exit_code == 0, result.stderr
    assert "DEPLOY_FAILED" not in result.output


def test_a_negative_memlock_stops_the_wait_with_the_engines_preflight_line(
    standins: Standins, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(eksctl, "MEMLOCK_BYTES", 2**63 - 1)  # 9a77e7e's: 2^63 after float64, -2^63 in CPython
    result = stopped_up(standins)
    assert ("deployment pdserve/decode DEPLOY_FAILED: pdserve.errors.EngineStartFailed: pdserve preflight: memlock "
            "(ulimit -l) is -8796093022208 MiB but NIXL must pin 20.4 GiB") in result.stderr

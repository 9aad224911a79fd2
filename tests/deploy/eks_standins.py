"""Stand-ins for eksctl, kubectl, helm and aws: ``python eks_standins.py TOOL ARGS...``, over one small
model of an EKS cluster kept in the JSON file $STANDIN_STATE.

Each call appends {"tool", "argv", "words", "stdin"} to $STANDIN_LOG. The model behaves as the real tools
and controllers do where pdserve once got them wrong; the source of each behaviour is cited where it is
modelled:
- eksctl builds node groups from the ClusterConfig on stdin, labels and taints their nodes, and installs
  the EFA device plugin (DaemonSet ``aws-efa-k8s-device-plugin``, tolerating only CriticalAddonsOnly and
  aws.amazon.com/efa) for an efaEnabled group and the NVIDIA device plugin (tolerating each NVIDIA group's
  taints) for a GPU group (eksctl pkg/addons/assets/*.yaml, pkg/addons/device_plugin.go).
- ``eksctl get nodegroup`` lists a node group in any state with exit 0, and exits 1 when it is absent
  (eksctl pkg/actions/nodegroup/get.go). STANDIN_NODEGROUP_FAILS=gpu[:REASON] makes that group's create fail
  and roll back: the group is gone, its stack stays ROLLBACK_COMPLETE (cfn_standin.py models the stacks).
- A DaemonSet runs a pod on a node only where its tolerations cover the node's NoSchedule taints and its
  node affinity matches; a node offers nvidia.com/gpu and vpc.amazonaws.com/efa only where that device
  plugin runs (the kubelet's device-plugin API).
- The scheduler places a pod where its nodeSelector, tolerations and requests fit, else leaves it Pending
  with a FailedScheduling event in kube-scheduler's words (pkg/scheduler/framework/types.go, FitError).
- KubeRay 1.6.2 gives a RayService worker without a readinessProbe one on Serve's proxy at :8000, which
  runs on the head only, so that worker is never Ready (ray-operator/controllers/ray/common/pod.go).
- ``kubectl exec`` returns the remote command's exit code and says ``command terminated with exit code N``
  (kubectl pkg/cmd/exec, CodeExitError); an engine pod's log holds pdserve's notes and NIXL's
  ``Backend X was instantiated`` (nixl src/api/python/_api.py); STANDIN_NIXL_BACKEND names X. With LIBFABRIC,
  NIXL's INFO line ``Created 1 rails using provider=P`` comes first (ENGINE_LOG); STANDIN_NIXL_PROVIDER names P.
- ``kubectl port-forward`` to the gateway reaches a gateway whose /metrics are the decode engine's NIXL
  counters as last scraped (pdserve/gateway/metrics.py, EngineKVCollector). Each completion POSTed with
  ``X-PD-Mode: pd`` and a prompt of token ids moves its KV: +1 transfer of STANDIN_KV_STATE_BYTES plus
  prompt tokens x STANDIN_KV_BYTES_PER_TOKEN at STANDIN_KV_GBPS (default 3, EFA on a g6.8xlarge); the scrape
  is modelled as immediate. ``X-PD-Mode: local`` runs on one engine and moves none. The defaults are
  Qwen3.5-9B's, the example's model (KV_BYTES_PER_TOKEN, KV_STATE_BYTES).
- The AWS CLI's read-only calls of ``cloud up``'s preflight answer as the APIs do, with the CLI's exit codes
  (253 for missing credentials, 254 for an error the service returned: AWS CLI User Guide, "Command line
  return codes"): ``sts get-caller-identity``, ``ec2 describe-instance-types``, ``service-quotas
  get-service-quota`` (STANDIN_QUOTAS="CODE=vCPUs ..."), ``ecr describe-images`` (STANDIN_ECR_IMAGES lists the
  pushed REPOSITORY:TAGs). Each answer cites its source where it is modelled.
- STANDIN_NO_CAPACITY lists zones where EC2 has no capacity for a GPU node group: its creation fails as eksctl's
  does by default (the CloudFormation stack rolls back and removes the group, the stack's CREATE_FAILED event
  keeps EKS's health issue), and ``eksctl delete nodegroup`` removes what is left.
Processes, with time as a count of reads in the state file (never wall-clock):
- Nodes register NotReady, tainted node.kubernetes.io/not-ready:NoSchedule and
  node.cloudprovider.kubernetes.io/uninitialized=true:NoSchedule, for the first STANDIN_NODE_NOT_READY_READS
  (default 1) reads of the nodes after their group is created, then Ready and untainted.
- DaemonSet pods carry the tolerations the DaemonSet controller adds to the template's, on the pods only.
- An image is pulled when a pod first runs: the check pod shows ContainerCreating on its first read, then exits
  (Succeeded, its termination message as the kubelet reads it) or shows the kubelet's pull failure, then
  ImagePullBackOff. STANDIN_IMAGE_PULL=not-found|unauthorized|bad-name makes every pull fail that way (transient: the
  first pull is cut by a connection reset, the kubelet's next one succeeds); a name
  the reference grammar refuses (an ``<account>`` placeholder) fails as bad-name by itself.
- KubeRay's worker pods wait in their ``wait-gcs-ready`` init container (Init:0/1) on the first read of the
  RayService; the Serve app is DEPLOYING on the next, RUNNING on the one after: running pods are not a running app.
- An engine replica reads the memlock its GPU node's NodeConfig (the node group's overrideBootstrapCommand) yields
  after nodeadm's merge, containerd and CPython; a negative one fails pdserve's preflight, and Serve marks the
  engine deployments DEPLOY_FAILED with its message.
No pdserve imports: it runs as a separate process, as the real tools would.
"""

from __future__ import annotations

import fcntl
import http.server
import json
import os
import re
import sys
from decimal import Decimal
from pathlib import Path
from typing import Any

import cfn_standin  # beside this file: python puts the script's folder first on sys.path
import yaml

# the decode engine's counters when the port-forward starts, under the names the gateway gives them
GATEWAY_KV_COUNTERS = {"pdserve_engine_kv_transfer_bytes": 4.0e8, "pdserve_engine_kv_transfer_seconds": 0.2,
                       "pdserve_engine_kv_transfers": 12.0, "pdserve_engine_kv_transfer_failures": 0.0}
# Qwen/Qwen3.5-9B's published config.json (pdserve/demo/shapes.py): 32 layers, every 4th full attention (8),
# 4 KV heads of 256, bf16: 8 x 4 x 256 x 2 (K, V) x 2 bytes of KV per token; the 24 Gated DeltaNet layers
# keep per request a float32 recurrent state (32 value heads x 128 x 128 x 4 bytes) and a bf16 conv state
# ((2 x 16 x 128 + 32 x 128) channels x (kernel 4 - 1) x 2 bytes). 3,072 tokens: 152.2 MB, and the H200 run
# of docs/benchmarks.md section 7 moved 156.4 MB (one 128-token block more).
KV_BYTES_PER_TOKEN = 8 * 4 * 256 * 2 * 2  # 32,768
KV_STATE_BYTES = 24 * (32 * 128 * 128 * 4 + (2 * 16 * 128 + 32 * 128) * 3 * 2)  # 51,511,296
OFFERINGS = {"InstanceTypeOfferings": [
    {"InstanceType": "g6.8xlarge", "Location": "us-west-2d"}, {"InstanceType": "g6.8xlarge", "Location": "us-west-2b"},
    {"InstanceType": "m7i.xlarge", "Location": "us-west-2a"}, {"InstanceType": "m7i.xlarge", "Location": "us-west-2b"},
]}
# (allocatable cpu, memory GiB, NVIDIA GPUs, EFA interfaces) per instance type, from EC2's specifications.
INSTANCE_TYPES = {"m7i.xlarge": ("3920m", 14, 0, 0), "g6.8xlarge": ("31850m", 120, 1, 1), "g6.xlarge": ("3920m", 14, 1, 0)}
EFA_PLUGIN = {"kind": "DaemonSet", "metadata": {"name": "aws-efa-k8s-device-plugin", "namespace": "kube-system",
                                                "labels": {"name": "aws-efa-k8s-device-plugin"}},
              "spec": {"selector": {"matchLabels": {"name": "aws-efa-k8s-device-plugin"}}, "template": {
                  "metadata": {"labels": {"name": "aws-efa-k8s-device-plugin"}},
                  "spec": {"hostNetwork": True,  # as eksctl's manifest has it: DaemonSet pods then tolerate network-unavailable
                           "tolerations": [{"key": "CriticalAddonsOnly", "operator": "Exists"},
                                           {"key": "aws.amazon.com/efa", "operator": "Exists", "effect": "NoSchedule"}],
                           "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
                               "nodeSelectorTerms": [{"matchExpressions": [{
                                   "key": "node.kubernetes.io/instance-type", "operator": "In",
                                   "values": ["g5.8xlarge", "g6.8xlarge", "g6e.8xlarge", "p4d.24xlarge", "p5.48xlarge"]}]}]}}}}}}}
NVIDIA_PLUGIN_NAME = "nvidia-device-plugin-daemonset"
DEVICE_PLUGINS = {"aws-efa-k8s-device-plugin": "vpc.amazonaws.com/efa", NVIDIA_PLUGIN_NAME: "nvidia.com/gpu"}


def main(tool: str, argv: list[str]) -> int:
    words = _without_context(argv)
    stdin = sys.stdin.read() if "-" in argv or any("/dev/stdin" in arg for arg in argv) else ""
    with open(os.environ["STANDIN_LOG"], "a") as log:
        log.write(json.dumps({"tool": tool, "argv": argv, "words": words, "stdin": stdin}) + "\n")
    if _is_failing(tool, words):
        if tool == "eksctl":  # its own lines on stdout, cobra's last line on stderr (cfn_standin.py)
            cfn_standin.critical(f"simulated failure of {tool} {' '.join(words)}")
        print(f"Error: simulated failure of {tool} {' '.join(words)}", file=sys.stderr)
        return 1
    if tool == "kubectl" and words[0] == "port-forward":
        return _serve_gateway()  # runs until killed, beside other calls: it neither reads nor writes the model
    # One call at a time reads and writes the model, as an API server serialises writes to one object.
    state_path = Path(os.environ["STANDIN_STATE"])
    with open(state_path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state: dict[str, Any] = json.loads(state_path.read_text()) if state_path.exists() else {}
        code = answer(tool, words, stdin, state)
        state_path.write_text(json.dumps(state))
    return code


def answer(tool: str, words: list[str], stdin: str, state: dict[str, Any]) -> int:
    command = " ".join([tool, *words])
    if tool in ("eksctl", "kubectl", "helm") and words[:1] == ["version"]:
        return cfn_standin.version(tool, words)
    if tool == "eksctl":
        return _eksctl(words, stdin, state)
    if command.startswith("aws ec2 describe-instance-type-offerings"):
        print(json.dumps(OFFERINGS))
    elif tool == "aws" and tuple(words[:2]) in AWS_READS:
        return AWS_READS[tuple(words[:2])](words, state)
    elif tool == "kubectl" and words[0] == "exec":
        return _exec(words, state)
    elif tool == "kubectl" and words[0] in ("get", "patch", "apply", "delete", "run", "create"):
        return _kubectl(words, stdin, state)
    else:
        return _create_get_delete(command, state)
    return 0


def _eksctl(words: list[str], stdin: str, state: dict[str, Any]) -> int:
    groups: dict[str, Any] = state.setdefault("nodegroups", {})
    name = _flag(words, "--name")
    if words[:2] == ["create", "cluster"]:
        metadata = yaml.safe_load(stdin)["metadata"]
        return cfn_standin.create_cluster(metadata["name"], metadata["region"], state)
    elif words[:2] == ["get", "cluster"]:
        return 0 if state.get("cluster") else _error(f"Error: unable to describe cluster control plane: {name} not found")
    elif words[:2] == ["delete", "cluster"]:
        return cfn_standin.delete_cluster(name, state)
    elif words[:2] == ["create", "nodegroup"]:
        return _create_node_group(words[-1], yaml.safe_load(stdin), state)
    elif words[:2] == ["delete", "nodegroup"]:
        return _delete_node_group(words, state)
    elif words[:2] == ["get", "nodegroup"]:
        if name not in groups:
            return _error(f"Error: operation error EKS: DescribeNodegroup, ResourceNotFoundException: No node group "
                          f"found for name: {name}.")
        summary = {"Cluster": _flag(words, "--cluster"), "Name": name, "Status": groups[name]["status"], "Type": "managed"}
        print(json.dumps([summary], indent=4) if _flag(words, "--output") == "json" else f"CLUSTER NODEGROUP STATUS\n"
              f"{summary['Cluster']} {name} {summary['Status']}")
    return 0


def _create_node_group(name: str, cluster_config: dict[str, Any], state: dict[str, Any]) -> int:
    """eksctl creates the group and then, in its post-creation tasks, the device plugins it needs."""
    (group,) = [group for group in cluster_config["managedNodeGroups"] if group["name"] == name]
    metadata = cluster_config["metadata"]
    if cfn_standin.excluded_groups(metadata["name"], [name], state):
        return 0  # nothing left to create
    if _lacks_capacity(group):
        return _fail_for_capacity(group, cluster_config, state)
    failing, _, reason = os.environ.get("STANDIN_NODEGROUP_FAILS", "").partition(":")
    if failing == name:
        kind, logical, message = cfn_standin.REASONS[reason or "vcpu"]
        return cfn_standin.node_group_failed(metadata["name"], metadata["region"], name, state, reason=message,
                                             kind=kind, logical=logical)
    state["nodegroups"][name] = {"status": "ACTIVE", "config": group, "born_at_read": state.get("node_reads", 0)}
    cfn_standin.node_group_created(metadata["name"], name, state)
    daemonsets = state.setdefault("daemonsets", {})
    if group.get("efaEnabled"):
        plugin = json.loads(json.dumps(EFA_PLUGIN))  # created or replaced
        if "STANDIN_EFA_TYPES" in os.environ:  # an eksctl whose manifest predates some EFA instance types
            (term,) = plugin["spec"]["template"]["spec"]["affinity"]["nodeAffinity"][
                "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
            term["matchExpressions"][0]["values"] = os.environ["STANDIN_EFA_TYPES"].split(",")
        daemonsets[EFA_PLUGIN["metadata"]["name"]] = plugin
    if INSTANCE_TYPES[group["instanceType"]][2]:
        tolerations = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"},
                       *({"key": taint["key"], "value": taint.get("value", "")} for taint in group.get("taints", []))]
        daemonsets[NVIDIA_PLUGIN_NAME] = {"kind": "DaemonSet", "metadata": {"name": NVIDIA_PLUGIN_NAME},
                                          "spec": {"template": {"metadata": {"labels": {"name": "nvidia-device-plugin-ds"}},
                                                                "spec": {"tolerations": tolerations}}}}
    return 0


def _kubectl(words: list[str], stdin: str, state: dict[str, Any]) -> int:
    namespace = _flag(words, "--namespace") or "default"
    if words[0] == "create" and words[1] == "-f":
        return _create_pod(yaml.safe_load(stdin), state)
    if words[0] == "patch":
        return _patch_daemonset(words, state)
    elif words[0] == "apply":
        for obj in yaml.safe_load_all(stdin):
            if obj["kind"] == "Namespace":
                state.setdefault("namespaces", []).append(obj["metadata"]["name"])
            elif obj["kind"] == "RayService":
                if state.get("rayservice") is None:
                    state["rayservice_reads"] = 0  # KubeRay creates its pods anew
                state["rayservice"] = obj
    elif words[0] == "delete":
        return _delete(words, state)
    elif words[0] == "create" and words[1] == "secret":
        state.setdefault("secrets", []).append(words[3])
    elif words[0] == "get":
        return _get(words, namespace, state)
    return 0


def _get(words: list[str], namespace: str, state: dict[str, Any]) -> int:
    positional = _positional(words[1:])
    kinds, name = positional[0].split(","), (positional[1] if len(positional) > 1 else "")
    if kinds == ["namespace"]:
        return 0 if name in state.get("namespaces", []) else _error(f'Error from server (NotFound): namespaces "{name}" not found')
    if kinds == ["secret"]:
        return 0 if name in state.get("secrets", []) else _error(f'Error from server (NotFound): secrets "{name}" not found')
    if kinds == ["crd"]:
        return 1  # no Prometheus Operator
    if kinds == ["pod"]:
        return _get_pod(name, namespace, state)
    _count_reads(kinds, state)
    nodes, pods = _nodes(state), _pods(state)
    items: list[dict[str, Any]] = []
    for kind in kinds:
        if kind in ("rayservice", "rayservices"):
            service = state.get("rayservice")
            if name and service is None:
                return _error(f'Error from server (NotFound): rayservices.ray.io "{name}" not found')
            items += [_with_status(service, pods, state)] if service else []
        elif kind == "nodes":
            items += nodes
        elif kind in ("daemonset", "daemonsets"):
            found = state.get("daemonsets", {}) if namespace == "kube-system" else {}
            if name and name not in found:
                return _error(f'Error from server (NotFound): daemonsets.apps "{name}" not found')
            items += [found[name]] if name else list(found.values())
        elif kind == "pods":
            items += [pod for pod in _plugin_pods(state, nodes) + pods if pod["metadata"]["namespace"] == namespace]
        elif kind == "events":
            items += [event for pod in pods if (event := _scheduling_event(pod))]
            items += [event for pod in pods for event in _pull_events(pod)]
    print(json.dumps(items[0] if name else {"kind": "List", "items": items}))
    return 0


# An engine's log: pdserve's notes (pdserve/engines/launcher.py), then NIXL's. Creating the LIBFABRIC backend
# logs, through Abseil's prefix (severity+MMDD time thread file:line]), "Created N rails using provider=X"
# at INFO (nixl src/utils/libfabric/libfabric_rail_manager.cpp), printed only at NIXL_LOG_LEVEL=INFO or lower
# (src/utils/common/nixl_log.cpp); then NIXL's Python API logs the backend through its formatter
# "%(asctime)s NIXL %(levelname)-7s %(filename)s:%(lineno)d %(message)s" (src/api/python/logging.py, _api.py).
ENGINE_LOG = """=== pdserve: starting {role}-0: python -m vllm.entrypoints.openai.api_server
=== pdserve: kv buffer cpu: EFA without GPUDirect RDMA (no peermem module loaded)
=== pdserve: libfabric provider efa: placement.efa_devices=1
{rails}2026-12-03 10:00:02 NIXL INFO    _api.py:405 Backend {backend} was instantiated
"""
RAILS_LINE = "I1203 10:00:02.512310     812 libfabric_rail_manager.cpp:232] Created 1 rails using provider={provider}\n"


def _exec(words: list[str], state: dict[str, Any]) -> int:
    """kubectl exec POD -c C -- grep ... PATTERN PATHS: grep -o over the pod's engine log; grep's exit 1 comes
    back as kubectl's, with its "command terminated" line (kubectl exec propagates the remote exit code)."""
    split = words.index("--")
    options, command = words[:split], words[split + 1:]
    container = _flag(options, "-c")
    name = next(word for word in _positional(options[1:]) if word != container)
    namespace = _flag(options, "--namespace") or "default"
    pods = {pod["metadata"]["name"]: pod for pod in _pods(state) if pod["metadata"]["namespace"] == namespace}
    if name not in pods:
        return _error(f'Error from server (NotFound): pods "{name}" not found')
    role = pods[name]["metadata"]["labels"].get("app.kubernetes.io/component")
    backend = os.environ.get("STANDIN_NIXL_BACKEND", "LIBFABRIC")
    # STANDIN_NIXL_PROVIDER: the provider libfabric opened; "" = no rails line (NIXL's default WARN level)
    provider = os.environ.get("STANDIN_NIXL_PROVIDER", "efa")
    rails = RAILS_LINE.format(provider=provider) if backend == "LIBFABRIC" and provider else ""
    log = ENGINE_LOG.format(role=role, backend=backend, rails=rails) if role in ("prefill", "decode") and backend else ""
    pattern = next(word for word in command[1:] if not word.startswith("-"))
    found = [match.group(0) for line in log.splitlines() for match in re.finditer(pattern, line)]
    if not found:
        return _error("command terminated with exit code 1")
    print("\n".join(found))
    return 0


def _patch_daemonset(words: list[str], state: dict[str, Any]) -> int:
    name = words[words.index("daemonset") + 1]
    daemonset = state.get("daemonsets", {}).get(name)
    if daemonset is None:
        return _error(f'Error from server (NotFound): daemonsets.apps "{name}" not found')
    patch = json.loads(_flag(words, "-p"))
    daemonset["spec"]["template"]["spec"].update(patch["spec"]["template"]["spec"])  # a merge patch replaces lists
    return 0


def _delete(words: list[str], state: dict[str, Any]) -> int:
    if words[1] == "-f":
        for key in ("namespaces", "rayservice", "secrets"):
            state.pop(key, None)
    elif words[1] == "rayservice":
        state.pop("rayservice", None)
    elif words[1] == "pod":
        state.get("pods", {}).pop(words[2], None)
    elif words[1] == "secret":
        state["secrets"] = [secret for secret in state.get("secrets", []) if secret != words[2]]
    return 0


def _nodes(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The nodes of every ACTIVE node group, each offering a device only where its plugin runs."""
    nodes = []
    for index, (name, group) in enumerate(sorted(state.get("nodegroups", {}).items())):
        if group["status"] != "ACTIVE":
            continue
        config = group["config"]
        cpu, memory, gpus, efa = INSTANCE_TYPES[config["instanceType"]]
        for number in range(config["desiredCapacity"]):
            labels = {**config.get("labels", {}), "node.kubernetes.io/instance-type": config["instanceType"],
                      "topology.kubernetes.io/zone": config["availabilityZones"][0], "eks.amazonaws.com/nodegroup": name}
            node = {"kind": "Node", "metadata": {"name": f"ip-10-0-{index + 1}-{number + 5}", "labels": labels},
                    "spec": {"taints": config.get("taints", [])},
                    "status": {"allocatable": {"cpu": cpu, "memory": f"{memory}Gi"}, "capacity": {},
                               "conditions": [{"type": "Ready", "status": "True"}]}}
            _while_coming_up(node, group, state)
            for plugin, resource in DEVICE_PLUGINS.items():
                count = {"nvidia.com/gpu": gpus, "vpc.amazonaws.com/efa": efa}[resource]
                daemonset = state.get("daemonsets", {}).get(plugin)
                if count and daemonset and _runs_on(_daemon_pod_spec(daemonset), node):
                    node["status"]["allocatable"][resource] = node["status"]["capacity"][resource] = str(count)
            nodes.append(node)
    return nodes


def _plugin_pods(state: dict[str, Any], nodes: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{"kind": "Pod", "metadata": {"name": f"{name}-{node['metadata']['name']}", "namespace": "kube-system",
                                         "labels": daemonset["spec"]["template"]["metadata"]["labels"]},
             "spec": {**_daemon_pod_spec(daemonset), "nodeName": node["metadata"]["name"]}, "status": {"phase": "Running"}}
            for name, daemonset in state.get("daemonsets", {}).items() for node in nodes
            if _runs_on(_daemon_pod_spec(daemonset), node)]


def _pods(state: dict[str, Any]) -> list[dict[str, Any]]:
    """KubeRay's pods for the RayService, each placed by the scheduler or left Pending."""
    service = state.get("rayservice")
    if service is None:
        return []
    cluster, namespace = service["spec"]["rayClusterConfig"], service["metadata"]["namespace"]
    groups = [("head", cluster["headGroupSpec"], 1)] + [
        (f"{group['groupName']}-worker", group, group["replicas"]) for group in cluster["workerGroupSpecs"]]
    free = {node["metadata"]["name"]: dict(node["status"]["allocatable"]) for node in _nodes(state)}
    nodes = {node["metadata"]["name"]: node for node in _nodes(state)}
    pods = []
    for group_name, group, replicas in groups:
        for number in range(replicas):
            spec = group["template"]["spec"]
            pod = {"kind": "Pod", "metadata": {"name": f"{service['metadata']['name']}-raycluster-{group_name}-{number}",
                                               "namespace": namespace, "labels": group["template"]["metadata"]["labels"]},
                   "spec": {**spec, "nodeName": ""}}
            _schedule(pod, nodes, free, is_worker=group_name != "head", number=len(pods))
            if group_name != "head":
                _wait_for_gcs(pod, state)
            _pull_image(pod, reads=state.get("rayservice_reads", 0))
            pods.append(pod)
    return pods


def _schedule(pod: dict[str, Any], nodes: dict[str, dict[str, Any]], free: dict[str, dict[str, str]], *,
              is_worker: bool, number: int) -> None:
    reasons: dict[str, int] = {}
    (container,) = pod["spec"]["containers"]
    requests = container["resources"]["requests"]
    for name, node in sorted(nodes.items()):
        selector = pod["spec"].get("nodeSelector") or {}
        if not selector.items() <= node["metadata"]["labels"].items():
            reason = "node(s) didn't match Pod's node affinity/selector"
        elif not _runs_on({"tolerations": pod["spec"].get("tolerations", [])}, node):
            taint = node["spec"]["taints"][0]
            reason = f"node(s) had untolerated taint {{{taint['key']}: {taint.get('value', '')}}}"
        else:
            short = [resource for resource, amount in requests.items() if _amount(free[name].get(resource, "0")) < _amount(amount)]
            if not short:
                for resource, amount in requests.items():
                    free[name][resource] = str(_amount(free[name].get(resource, "0")) - _amount(amount))
                ready = not is_worker or "readinessProbe" in container
                pod["spec"]["nodeName"] = name
                pod["status"] = {"phase": "Running", "podIP": ".".join(name.split("-")[1:4]) + f".{100 + number}",
                                 "conditions": [{"type": "PodScheduled", "status": "True"}],
                                 "containerStatuses": [{"ready": ready, "restartCount": 0, "state": {"running": {}}}]}
                return
            reason = f"Insufficient {short[0]}"
        reasons[reason] = reasons.get(reason, 0) + 1
    listed = ", ".join(sorted(f"{count} {reason}" for reason, count in reasons.items()))  # as FitError.Error sorts
    message = f"0/{len(nodes)} nodes are available: {listed}. preemption: 0/{len(nodes)} nodes are available: " \
              f"{len(nodes)} Preemption is not helpful for scheduling."
    pod["status"] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False",
                                                         "reason": "Unschedulable", "message": message}]}


def _scheduling_event(pod: dict[str, Any]) -> dict[str, Any] | None:
    condition = pod["status"]["conditions"][0]
    if condition["status"] == "True":
        return None
    return {"kind": "Event", "type": "Warning", "reason": "FailedScheduling", "message": condition["message"],
            "involvedObject": {"kind": "Pod", "name": pod["metadata"]["name"]}, "lastTimestamp": "2026-12-03T10:00:00Z"}


def _with_status(service: dict[str, Any], pods: list[dict[str, Any]], state: dict[str, Any]) -> dict[str, Any]:
    """Serve's app deploys once its pods run, and runs one read later; an engine replica that fails its
    preflight makes its deployment DEPLOY_FAILED instead. KubeRay's Ready follows (numServeEndpoints > 0)."""
    is_running = bool(pods) and all(pod["status"]["phase"] == "Running" for pod in pods)
    is_deployed = is_running and state.get("rayservice_reads", 0) >= SERVE_RUNNING_AFTER_READS
    failure = _engine_preflight_failure(state) if is_deployed else ""
    deployments = {name: {"status": "HEALTHY" if is_deployed else "UPDATING"} for name in ("prefill", "decode", "gateway")}
    if failure:
        for name in ("prefill", "decode"):
            deployments[name] = {"status": "DEPLOY_FAILED", "message": SERVE_FAILURE.format(deployment=name, problem=failure)}
    app_status = "DEPLOY_FAILED" if failure else "RUNNING" if is_deployed else "DEPLOYING"
    is_up = is_deployed and not failure
    app = {"status": app_status, "serveDeploymentStatuses": deployments}
    return {**service, "status": {
        "conditions": [{"type": "Ready", "status": str(is_up), "reason": "NonZeroServeEndpoints" if is_up else "Initializing"}],
        ("activeServiceStatus" if is_up else "pendingServiceStatus"): {"applicationStatuses": {"pdserve": app}}}}


def _runs_on(pod_spec: dict[str, Any], node: dict[str, Any]) -> bool:
    """Tolerations cover the node's NoSchedule taints and the required node affinity matches."""
    for taint in node["spec"].get("taints", []):
        if not any(_tolerates(toleration, taint) for toleration in pod_spec.get("tolerations", [])):
            return False
    terms = (((pod_spec.get("affinity") or {}).get("nodeAffinity") or {})
             .get("requiredDuringSchedulingIgnoredDuringExecution") or {}).get("nodeSelectorTerms") or []
    labels = node["metadata"]["labels"]
    return not terms or any(all(labels.get(expression["key"]) in expression["values"]
                                for expression in term["matchExpressions"]) for term in terms)


def _tolerates(toleration: dict[str, Any], taint: dict[str, Any]) -> bool:
    if toleration.get("effect") and toleration["effect"] != taint["effect"]:
        return False
    if toleration.get("operator") == "Exists":
        return not toleration.get("key") or toleration["key"] == taint["key"]
    return bool(toleration.get("key") == taint["key"] and toleration.get("value", "") == taint.get("value", ""))


def _amount(value: object) -> float:
    text = str(value)
    for suffix, scale in (("m", 1e-3), ("Gi", 2.0**30), ("Mi", 2.0**20)):
        if text.endswith(suffix):
            return float(text.removesuffix(suffix)) * scale
    return float(text)


def _create_get_delete(command: str, state: dict[str, Any]) -> int:
    """aws, helm and kubeconfig commands that make, look up or remove one named thing."""
    things = {
        "context": ("aws eks update-kubeconfig", "kubectl config get-contexts", "kubectl config delete-context"),
        "kuberay": ("helm upgrade --install", "helm status", "helm uninstall"),
    }
    for thing, (create, get, delete) in things.items():
        if command.startswith(create):
            state[thing] = True
        elif command.startswith(get):
            return 0 if state.get(thing) else 1
        elif command.startswith(delete):
            state.pop(thing, None)
    return 0  # helm repo add: nothing to remember


# The processes, in the order `cloud up` meets them; time is a count of reads kept in the state file.
SERVE_RUNNING_AFTER_READS = 3  # reads of the RayService: 1 head up, workers in wait-gcs-ready; 2 DEPLOYING; 3 RUNNING
# The taints a node is born with and loses once Ready (kubernetes pkg/controller/nodelifecycle/
# node_lifecycle_controller.go: not-ready:NoSchedule while the Ready condition is False; k8s.io/cloud-provider
# api/well_known_taints.go: the kubelet registers with an external cloud provider's uninitialized taint and the
# cloud controller manager removes it, controllers/node/node_controller.go).
COMING_UP_TAINTS = [{"key": "node.kubernetes.io/not-ready", "effect": "NoSchedule"},
                    {"key": "node.cloudprovider.kubernetes.io/uninitialized", "value": "true", "effect": "NoSchedule"}]
# What the kubelet reports until the VPC CNI is up (pkg/kubelet/nodestatus/setters.go, ReadyCondition).
NOT_READY = {"type": "Ready", "status": "False", "reason": "KubeletNotReady",
             "message": "container runtime network not ready: NetworkReady=false reason:NetworkPluginNotReady "
                        "message:Network plugin returns error: cni plugin not initialized"}
# Added by the DaemonSet controller to each pod, not to the template (kubernetes pkg/controller/daemon/util/
# daemonset_util.go AddOrUpdateDaemonPodTolerations, called from daemon_controller.go NewPod); network-unavailable
# only for hostNetwork pods. not-ready:NoSchedule is not among them: a DaemonSet pod waits for a Ready node.
DAEMON_POD_TOLERATIONS = [
    *({"key": f"node.kubernetes.io/{key}", "operator": "Exists", "effect": "NoExecute"} for key in ("not-ready", "unreachable")),
    *({"key": f"node.kubernetes.io/{key}", "operator": "Exists", "effect": "NoSchedule"}
      for key in ("disk-pressure", "memory-pressure", "pid-pressure", "unschedulable")),
]
# Serve's message for a deployment whose replicas failed to start (python/ray/serve/_private/deployment_state.py,
# _check_curr_status), with the replica's traceback; pdserve's EngineReplica raises EngineStartFailed.
SERVE_FAILURE = ("The deployment failed to start 3 times in a row. This may be due to a problem with its constructor "
                 "or initial health check failing. See controller logs for details. Error:\n"
                 "ray::ServeReplica:pdserve:{deployment}.initialize_and_get_metadata() (pid=2406, ip=10.0.2.5)\n"
                 '  File "/home/ray/anaconda3/lib/python3.12/concurrent/futures/_base.py", line 449, in result\n'
                 "    return self.__get_result()\n"
                 "pdserve.errors.EngineStartFailed: pdserve preflight: {problem}\n")


def _count_reads(kinds: list[str], state: dict[str, Any]) -> None:
    if "nodes" in kinds:
        state["node_reads"] = state.get("node_reads", 0) + 1
    if {"rayservice", "rayservices"} & set(kinds) and state.get("rayservice") is not None:
        state["rayservice_reads"] = state.get("rayservice_reads", 0) + 1


def _while_coming_up(node: dict[str, Any], group: dict[str, Any], state: dict[str, Any]) -> None:
    """A node NotReady and tainted for its first STANDIN_NODE_NOT_READY_READS reads."""
    reads = state.get("node_reads", 0) - group.get("born_at_read", 0)
    if reads <= int(os.environ.get("STANDIN_NODE_NOT_READY_READS", "1")):
        node["spec"]["taints"] = [*node["spec"]["taints"], *COMING_UP_TAINTS]
        node["status"]["conditions"] = [NOT_READY]


def _daemon_pod_spec(daemonset: dict[str, Any]) -> dict[str, Any]:
    spec = daemonset["spec"]["template"]["spec"]
    added = [*DAEMON_POD_TOLERATIONS, *([{"key": "node.kubernetes.io/network-unavailable", "operator": "Exists",
                                          "effect": "NoSchedule"}] if spec.get("hostNetwork") else [])]
    return {**spec, "tolerations": [*spec.get("tolerations", []), *added]}


def _wait_for_gcs(pod: dict[str, Any], state: dict[str, Any]) -> None:
    """KubeRay injects ``wait-gcs-ready`` into every worker pod, running the worker's image until ``ray
    health-check`` reaches the head's GCS (ray-operator/controllers/ray/common/pod.go, DefaultWorkerPodTemplate,
    ENABLE_INIT_CONTAINER_INJECTION on by default): the pod is Pending, Init:0/1, meanwhile."""
    pod["spec"]["initContainers"] = [{"name": "wait-gcs-ready", "image": pod["spec"]["containers"][0]["image"]}]
    if pod["status"]["phase"] != "Running":
        return
    if state.get("rayservice_reads", 0) > 1:
        pod["status"]["initContainerStatuses"] = [{"name": "wait-gcs-ready", "ready": True, "state": {
            "terminated": {"exitCode": 0, "reason": "Completed"}}}]
        return
    pod["status"].update(phase="Pending", initContainerStatuses=[
        {"name": "wait-gcs-ready", "ready": False, "state": {"running": {}}}])
    pod["status"]["containerStatuses"] = [{"ready": False, "restartCount": 0,
                                           "state": {"waiting": {"reason": "PodInitializing"}}}]


def _pull_failure(image: str) -> tuple[str, str, str] | None:
    """(waiting reason, its message, the kubelet's Warning event) for a pull that fails, else None.

    The kubelet refuses a name it cannot parse before pulling (pkg/kubelet/images/image_manager.go,
    EnsureImageExists: "Failed to apply default image tag"; pkg/util/parsers/parsers.go ParseImageName;
    distribution/reference's "invalid reference format"), and passes a runtime's pull error on as ErrImagePull
    (evalCRIPullErr), whose text is containerd's (client/pull.go "failed to resolve reference"; internal/cri/server/
    images/image_pull.go "failed to pull and unpack image"; core/remotes/docker/resolver.go: "REF: not found" on a
    404, "unexpected status from HEAD request to URL: 403 Forbidden" when the registry refuses the node) behind gRPC's
    "rpc error: code = ... desc = ..."."""
    kind = os.environ.get("STANDIN_IMAGE_PULL", "")
    if kind == "bad-name" or not re.fullmatch(r"[a-z0-9][a-z0-9._/-]*(:[A-Za-z0-9_][A-Za-z0-9_.-]*)?", image.rsplit("@", 1)[0]):
        message = f'Failed to apply default image tag "{image}": couldn\'t parse image name "{image}": invalid reference format'
        return "InvalidImageName", message, message
    # a name without a registry is Docker Hub's, "library/" for one path component (distribution/reference
    # normalize.go); containerd asks registry-1.docker.io for it (core/remotes/docker/config/hosts.go)
    host, _, rest = image.partition("/") if "." in image.split("/")[0] else ("docker.io", "", image)
    repository, _, tag = rest.partition(":")
    repository = repository if host != "docker.io" or "/" in repository else f"library/{repository}"
    reference = f"{host}/{repository}:{tag or 'latest'}"
    resolve = f'failed to pull and unpack image "{reference}": failed to resolve reference "{reference}"'
    if kind == "not-found":
        message = f"rpc error: code = NotFound desc = {resolve}: {reference}: not found"
    elif kind == "transient":  # the layer download cut by the network (containerd's copy of a blob over TCP)
        message = (f"rpc error: code = Unknown desc = {resolve[:resolve.index(': failed to resolve')]}: failed to copy: "
                   "read tcp 10.0.1.5:43210->52.94.1.1:443: read: connection reset by peer")
    elif kind == "unauthorized":
        url = f"https://{'registry-1.docker.io' if host == 'docker.io' else host}/v2/{repository}/manifests/{tag or 'latest'}"
        message = f"rpc error: code = Unknown desc = {resolve}: unexpected status from HEAD request to {url}: 403 Forbidden"
    else:
        return None
    return "ErrImagePull", message, f'Failed to pull image "{image}": {message}'


def _pull_waiting(image: str, *, reads: int) -> dict[str, str] | None:
    """The container's waiting state while its image is pulled: ContainerCreating on the first read, the
    failure on the next, then ImagePullBackOff while the kubelet backs off (image_manager.go "Back-off pulling image")."""
    failure = _pull_failure(image)
    if failure is not None and (failure[0] == "InvalidImageName" or reads == 2):
        return {"reason": failure[0], "message": failure[1]}
    if os.environ.get("STANDIN_IMAGE_PULL") == "transient" and reads > 2:
        return None  # the kubelet's next try pulls it

    if failure is not None and reads > 2:
        return {"reason": "ImagePullBackOff", "message": f'Back-off pulling image "{image}"'}
    return {"reason": "ContainerCreating"} if reads < 2 else None


def _pull_image(pod: dict[str, Any], *, reads: int) -> None:
    """A RayService pod whose image cannot be pulled: waiting where the pull happens first (the init container)."""
    image = pod["spec"]["containers"][0]["image"]
    transient = os.environ.get("STANDIN_IMAGE_PULL") == "transient"  # cut once, on the check pod's pull only
    if pod["status"]["phase"] == "Pending" and not pod["spec"]["nodeName"] or _pull_failure(image) is None or transient:
        return
    waiting = _pull_waiting(image, reads=max(reads, 2)) or {}
    statuses = "initContainerStatuses" if pod["spec"].get("initContainers") else "containerStatuses"
    pod["status"].update(phase="Pending", containerStatuses=[{"ready": False, "restartCount": 0, "state": {
        "waiting": {"reason": "PodInitializing"} if statuses == "initContainerStatuses" else waiting}}])
    pod["status"][statuses] = [{"name": "wait-gcs-ready" if statuses == "initContainerStatuses" else "ray",
                                "ready": False, "restartCount": 0, "state": {"waiting": waiting}}]


def _pull_events(pod: dict[str, Any]) -> list[dict[str, Any]]:
    """The kubelet's events for a pull that failed (pkg/kubelet/events/event.go reasons)."""
    image = pod["spec"]["containers"][0]["image"]
    failure = _pull_failure(image)
    if failure is None or not pod["spec"]["nodeName"]:
        return []
    reason = "InspectFailed" if failure[0] == "InvalidImageName" else "Failed"
    involved = {"kind": "Pod", "name": pod["metadata"]["name"]}
    return [{"kind": "Event", "type": "Warning", "reason": reason, "message": failure[2], "involvedObject": involved,
             "lastTimestamp": "2026-12-03T10:00:00Z"}]


def _create_pod(manifest: dict[str, Any], state: dict[str, Any]) -> int:
    """``kubectl create -f -`` of one Pod: refused when it exists (AlreadyExists), as the API server does."""
    pods = state.setdefault("pods", {})
    name = manifest["metadata"]["name"]
    if name in pods:
        return _error(f'Error from server (AlreadyExists): error when creating "STDIN": pods "{name}" already exists')
    pods[name] = {"manifest": manifest, "reads": 0}
    print(f"pod/{name} created")
    return 0


def _get_pod(name: str, namespace: str, state: dict[str, Any]) -> int:
    record = state.get("pods", {}).get(name)
    if record is None or record["manifest"]["metadata"].get("namespace", "default") != namespace:
        return _error(f'Error from server (NotFound): pods "{name}" not found')
    record["reads"] += 1
    print(json.dumps({**record["manifest"], "status": _one_off_pod_status(record["manifest"], reads=record["reads"],
                                                                          nodes=_nodes(state))}))
    return 0


def _one_off_pod_status(manifest: dict[str, Any], *, reads: int, nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """A restartPolicy Never pod: placed on a node its selector and tolerations allow, its image pulled, its
    command run once; Succeeded or Failed with the kubelet's termination message."""
    spec = manifest["spec"]
    selector = spec.get("nodeSelector") or {}
    if not any(selector.items() <= node["metadata"]["labels"].items() and _runs_on(spec, node) for node in nodes):
        return {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable"}]}
    (container,) = spec["containers"]
    waiting = _pull_waiting(container["image"], reads=reads)
    status: dict[str, Any] = {"phase": "Pending", "conditions": [{"type": "PodScheduled", "status": "True"}]}
    if waiting is not None:
        return {**status, "containerStatuses": [{"name": container["name"], "ready": False, "restartCount": 0,
                                                 "state": {"waiting": waiting}}]}
    terminated = _run_ray_version_command(container)
    return {**status, "phase": "Succeeded" if terminated["exitCode"] == 0 else "Failed", "containerStatuses": [
        {"name": container["name"], "ready": False, "restartCount": 0, "state": {"terminated": terminated}}]}


def _run_ray_version_command(container: dict[str, Any]) -> dict[str, Any]:
    """The container's ``python -c`` under an image with Ray STANDIN_IMAGE_RAY_VERSION ('' = no Ray). The kubelet
    reads the termination message from terminationMessagePath, falling back to the log's tail on an error exit
    with FallbackToLogsOnError (kubernetes.io/docs/tasks/debug/debug-application/determine-reason-pod-failure/)."""
    version = os.environ.get("STANDIN_IMAGE_RAY_VERSION", "2.60.0")
    path = container.get("terminationMessagePath", "/dev/termination-log")
    code = " ".join(container.get("command", []) + container.get("args", []))
    if not version:
        log = ('Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'
               "ModuleNotFoundError: No module named 'ray'\n")
        message = log if container.get("terminationMessagePolicy") == "FallbackToLogsOnError" else ""
        return {"exitCode": 1, "reason": "Error", "message": message}
    return {"exitCode": 0, "reason": "Completed", "message": version if path in code and "__version__" in code else ""}


def _engine_preflight_failure(state: dict[str, Any]) -> str:
    """Why the engine replicas' preflight fails on their GPU nodes (a negative memlock), else ''."""
    for group in state.get("nodegroups", {}).values():
        node_config = yaml.safe_load(group["config"].get("overrideBootstrapCommand") or "null")
        limit = _container_memlock_bytes(node_config) if isinstance(node_config, dict) else None
        if limit is not None and limit < 0 and limit != -1:  # -1 is RLIM_INFINITY, which pdserve reads as unlimited
            # pdserve/engines/host_checks.py memlock_problem's words, for a g6.8xlarge's 22.5 GiB L4
            return (f"memlock (ulimit -l) is {limit / 2**20:.0f} MiB but NIXL must pin 20.4 GiB (the KV staging "
                    "buffer, up to 20.2 GiB of a 22.5 GiB GPU, and libfabric's efa packet pools)")
    return ""


def _container_memlock_bytes(node_config: dict[str, Any]) -> int | None:
    """RLIMIT_MEMLOCK's soft limit as CPython's resource.getrlimit returns it in a container of a node bootstrapped
    with ``node_config``, or None when the NodeConfig sets none.

    nodeadm merges spec.containerd.baseRuntimeSpec by decoding JSON into map[string]interface{}, so the number
    becomes a float64 (amazon-eks-ami nodeadm/internal/containerd/base_runtime_spec.go, nodeadm/internal/util/
    merge.go), and writes it back with Go's encoding/json: the shortest digits that round-trip, in 'f' format
    below 1e21, so zero-padded (encoding/json encode.go floatEncoder, strconv.AppendFloat(f, 'f', -1, 64)); Python's
    repr gives the same shortest digits. containerd decodes the file into the OCI spec, whose rlimits are uint64
    (opencontainers/runtime-spec specs-go/config.go POSIXRlimit), and CPython converts rlim_t to a signed long long
    (Modules/resource.c rlimit2py)."""
    process = ((node_config.get("spec") or {}).get("containerd") or {}).get("baseRuntimeSpec", {}).get("process") or {}
    soft = next((rlimit["soft"] for rlimit in process.get("rlimits", []) if rlimit["type"] == "RLIMIT_MEMLOCK"), None)
    if soft is None:
        return None
    written = int(Decimal(repr(float(soft))))
    if not 0 <= written < 2**64:
        raise ValueError(f"containerd cannot decode rlimit {written} into uint64: not modelled")
    return written - 2**64 if written >= 2**63 else written


def _serve_gateway() -> int:
    """``kubectl port-forward``: a gateway on a free local port, announced as kubectl does. Its KV counters
    grow with each PD-mode completion, as the real gateway's do one scrape after the decode engine's."""
    counters = dict(GATEWAY_KV_COUNTERS)
    gbps = float(os.environ.get("STANDIN_KV_GBPS", "3"))
    bytes_per_token = int(os.environ.get("STANDIN_KV_BYTES_PER_TOKEN", KV_BYTES_PER_TOKEN))
    state_bytes = int(os.environ.get("STANDIN_KV_STATE_BYTES", KV_STATE_BYTES))

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._reply(200, "ok" if self.path == "/health" else _gateway_metrics(counters), content_type="text/plain")

        def do_POST(self) -> None:
            prompt = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["prompt"]
            if self.headers.get("X-PD-Mode") == "pd" and isinstance(prompt, list):  # pdserve/protocol.py
                kv_bytes = state_bytes + len(prompt) * bytes_per_token
                counters["pdserve_engine_kv_transfer_bytes"] += kv_bytes
                counters["pdserve_engine_kv_transfer_seconds"] += kv_bytes / (gbps * 1e9)
                counters["pdserve_engine_kv_transfers"] += 1
            self._reply(200, json.dumps({"choices": [{"token_ids": [5, 6, 7]}]}), content_type="application/json")

        def _reply(self, status: int, body: str, *, content_type: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body.encode())))
            self.end_headers()
            self.wfile.write(body.encode())

        def log_message(self, *_args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Gateway)
    print(f"Forwarding from 127.0.0.1:{server.server_address[1]} -> 9000", flush=True)
    server.serve_forever()
    return 0


def _gateway_metrics(counters: dict[str, float]) -> str:
    """The KV counters as the gateway's registry writes them."""
    return "".join(f"# TYPE {name}_total counter\n{name}_total{{endpoint=\"http://10.0.3.7:8200\"}} {value}\n"
                   for name, value in counters.items())


def _positional(words: list[str]) -> list[str]:
    """The words that are not flags or flag values (kubectl get's TYPE[,TYPE...] [NAME])."""
    kept, skip = [], False
    for word in words:
        if skip:
            skip = False
        elif word in ("--namespace", "-n", "-o", "--output"):
            skip = True
        elif not word.startswith("-"):
            kept.append(word)
    return kept


def _flag(words: list[str], flag: str) -> str:
    for index, word in enumerate(words):
        if word == flag and index + 1 < len(words):
            return words[index + 1]
        if word.startswith(flag + "="):
            return word.split("=", 1)[1]
    return ""


def _error(message: str) -> int:
    print(message, file=sys.stderr)
    return 1


def _without_context(argv: list[str]) -> list[str]:
    """The arguments without ``--context X``/``--kube-context X``, so commands compare by verb."""
    words: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--context", "--kube-context"):
            skip = True
        else:
            words.append(arg)
    return words


def _is_failing(tool: str, words: list[str]) -> bool:
    failing = os.environ.get("STANDIN_FAIL", "").split()
    if not failing or failing[0] != tool:
        return False
    remaining = iter(words)
    return all(word in remaining for word in failing[1:])


# vCPUs per instance type (EC2 API DescribeInstanceTypes, VCpuInfo.DefaultVCpus; g6.8xlarge 32, m7i.xlarge 4,
# g6.xlarge 4 as EC2's instance type pages list them)
VCPUS = {"g6.8xlarge": 32, "m7i.xlarge": 4, "g6.xlarge": 4}
# what a new stand-in account may run; the quota names are Service Quotas' own
QUOTA_NAMES = {"L-DB2E81BA": "Running On-Demand G and VT instances", "L-417A185B": "Running On-Demand P instances",
               "L-1216C47A": "Running On-Demand Standard (A, C, D, H, I, M, R, T, Z) instances"}
DEFAULT_QUOTAS = {"L-DB2E81BA": 64.0, "L-417A185B": 0.0, "L-1216C47A": 32.0}
ACCOUNT = "123456789012"
REGIONS = ("us-east-1", "us-east-2", "us-west-1", "us-west-2", "eu-west-1", "eu-central-1", "ap-northeast-1")


def _service_error(code: str, operation: str, message: str) -> int:
    """The AWS CLI's line for an error the service returned, and its exit code 254 (AWS CLI User Guide,
    "Command line return codes"; awscli clidriver prints ClientError as below)."""
    print(f"\nAn error occurred ({code}) when calling the {operation} operation: {message}", file=sys.stderr)
    return 254


def _caller_identity(words: list[str], state: dict[str, Any]) -> int:
    """sts get-caller-identity (STS API GetCallerIdentity: UserId, Account, Arn), from the region's STS endpoint
    (the AWS CLI v2 default). Without credentials botocore raises NoCredentialsError before any request, which
    the CLI prints with its hint and exit code 253."""
    region = _flag(words, "--region")
    if region not in REGIONS:  # no such endpoint: botocore's EndpointConnectionError, the CLI's exit code 255
        print(f'\nCould not connect to the endpoint URL: "https://sts.{region}.amazonaws.com/"', file=sys.stderr)
        return 255
    if os.environ.get("STANDIN_AWS_CREDENTIALS") == "none":
        print('\nUnable to locate credentials. You can configure credentials by running "aws configure".',
              file=sys.stderr)
        return 253
    print(json.dumps({"UserId": "AIDAEXAMPLEUSERID", "Account": ACCOUNT, "Arn": f"arn:aws:iam::{ACCOUNT}:user/demo"}))
    return 0


def _instance_types(words: list[str], state: dict[str, Any]) -> int:
    """ec2 describe-instance-types --instance-types T... (EC2 API DescribeInstanceTypes; an unknown name is the
    error InvalidInstanceType)."""
    names = words[words.index("--instance-types") + 1:]
    names = names[:next((index for index, word in enumerate(names) if word.startswith("--")), len(names))]
    unknown = [name for name in names if name not in VCPUS]
    if unknown:
        return _service_error("InvalidInstanceType", "DescribeInstanceTypes",
                              f"The following supplied instance types do not exist: [{', '.join(unknown)}]")
    print(json.dumps({"InstanceTypes": [{"InstanceType": name, "VCpuInfo": {"DefaultVCpus": VCPUS[name]}}
                                        for name in names]}))
    return 0


def _service_quota(words: list[str], state: dict[str, Any]) -> int:
    """service-quotas get-service-quota and get-aws-default-service-quota (Service Quotas API GetServiceQuota,
    GetAWSDefaultServiceQuota: {"Quota": {..., "Value": <double>}}); STANDIN_QUOTAS="L-DB2E81BA=32" sets a quota's
    value; a quota in STANDIN_QUOTAS_UNSET has no value of the account's (GetServiceQuota: NoSuchResourceException)."""
    code, region = _flag(words, "--quota-code"), _flag(words, "--region")
    quotas = {**DEFAULT_QUOTAS, **{key: float(value) for key, _, value in
                                   (item.partition("=") for item in os.environ.get("STANDIN_QUOTAS", "").split())}}
    unset = words[1] == "get-service-quota" and code in os.environ.get("STANDIN_QUOTAS_UNSET", "").split()
    if code not in QUOTA_NAMES or unset:  # STANDIN_QUOTAS_UNSET: never applied to the account, only AWS's default
        operation = "GetServiceQuota" if words[1] == "get-service-quota" else "GetAWSDefaultServiceQuota"
        return _service_error("NoSuchResourceException", operation, f"The request failed because the "
                              f"specified service quota {code} does not exist.")
    print(json.dumps({"Quota": {"ServiceCode": "ec2", "ServiceName": "Amazon Elastic Compute Cloud (Amazon EC2)",
                                "QuotaArn": f"arn:aws:servicequotas:{region}:{ACCOUNT}:ec2/{code}", "QuotaCode": code,
                                "QuotaName": QUOTA_NAMES[code], "Value": quotas[code], "Unit": "None",
                                "Adjustable": True, "GlobalQuota": False}}))
    return 0


def _ecr_images(words: list[str], state: dict[str, Any]) -> int:
    """ecr describe-images --image-ids imageTag=T (ECR API DescribeImages: imageDetails; the errors
    RepositoryNotFoundException and ImageNotFoundException in ECR's words, as the AWS provider for Terraform
    quotes them in hashicorp/terraform-provider-aws#35268)."""
    registry, repository = _flag(words, "--registry-id"), _flag(words, "--repository-name")
    tag = _flag(words, "--image-ids").removeprefix("imageTag=")
    pushed = [item.partition(":") for item in os.environ.get("STANDIN_ECR_IMAGES", "").split()]
    if repository not in [name for name, _, _ in pushed]:
        return _service_error("RepositoryNotFoundException", "DescribeImages", f"The repository with name "
                              f"'{repository}' does not exist in the registry with id '{registry}'")
    if (repository, tag) not in [(name, found) for name, _, found in pushed]:
        return _service_error("ImageNotFoundException", "DescribeImages", f"The image with imageId "
                              f"{{imageDigest:'null', imageTag:'{tag}'}} does not exist within the repository with "
                              f"name '{repository}' in the registry with id '{registry}'")
    print(json.dumps({"imageDetails": [{"registryId": registry, "repositoryName": repository, "imageTags": [tag],
                                        "imageDigest": "sha256:" + "ab" * 32, "imageSizeInBytes": 9_100_000_000}]}))
    return 0


def _node_group_health(words: list[str], state: dict[str, Any]) -> int:
    """eks describe-nodegroup --query nodegroup.health (EKS API DescribeNodegroup; a group that is gone is
    ResourceNotFoundException, as eksctl quotes it above)."""
    name = _flag(words, "--nodegroup-name")
    group = state.get("nodegroups", {}).get(name)
    if group is None:
        return _service_error("ResourceNotFoundException", "DescribeNodegroup", f"No node group found for name: {name}.")
    print(json.dumps(group.get("health", {"issues": []})))
    return 0


def _stack_events(words: list[str], state: dict[str, Any]) -> int:
    """cloudformation describe-stack-events --query "StackEvents[?ResourceStatus=='CREATE_FAILED']
    .ResourceStatusReason" (CloudFormation API DescribeStackEvents; a stack that does not exist is a
    ValidationError)."""
    name = _flag(words, "--stack-name")
    stack = state.get("stacks", {}).get(name)
    if stack is None:
        return _service_error("ValidationError", "DescribeStackEvents", f"Stack [{name}] does not exist")
    print(json.dumps(stack["failed_reasons"]))
    return 0


AWS_READS = {("sts", "get-caller-identity"): _caller_identity, ("ec2", "describe-instance-types"): _instance_types,
             ("service-quotas", "get-service-quota"): _service_quota,
             ("service-quotas", "get-aws-default-service-quota"): _service_quota, ("ecr", "describe-images"): _ecr_images,
             ("eks", "describe-nodegroup"): _node_group_health, ("cloudformation", "describe-stack-events"): _stack_events,
             ("cloudformation", "describe-stacks"): cfn_standin.describe_stacks}


def _lacks_capacity(group: dict[str, Any]) -> bool:
    zones = os.environ.get("STANDIN_NO_CAPACITY", "").split(",")
    return bool(INSTANCE_TYPES[group["instanceType"]][2]) and group["availabilityZones"][0] in zones


def _fail_for_capacity(group: dict[str, Any], cluster_config: dict[str, Any], state: dict[str, Any]) -> int:
    """A managed node group whose instances EC2 cannot launch: EKS marks it CREATE_FAILED with the health issue
    AsgInstanceLaunchFailures quoting EC2's InsufficientInstanceCapacity (aws/containers-roadmap#2204); the
    AWS::EKS::Nodegroup resource fails with that issue as its reason, and the stack, created without
    DisableRollback (eksctl pkg/cfn/manager/api.go), rolls back and removes the group; eksctl prints the
    CREATE_FAILED reason on stdout (cfn_standin.node_group_failed)."""
    cluster, zone, kind = cluster_config["metadata"]["name"], group["availabilityZones"][0], group["instanceType"]
    message = (f"Could not launch On-Demand Instances. InsufficientInstanceCapacity - We currently do not have "
               f"sufficient {kind} capacity in the Availability Zone you requested ({zone}). Our system will be "
               f"working on provisioning additional capacity. You can currently get {kind} capacity by not specifying "
               f"an Availability Zone in your request or choosing us-west-2a, us-west-2c. Launching EC2 instance failed.")
    reason = (f'Resource handler returned message: "[Issue(Code=AsgInstanceLaunchFailures, Message={message}, '
              f'ResourceIds=[eks-{group["name"]}-0ec8])] (Service: null, Status Code: 0, Request ID: null)"')
    return cfn_standin.node_group_failed(cluster, cluster_config["metadata"]["region"], group["name"], state,
                                         reason=reason)


def _delete_node_group(words: list[str], state: dict[str, Any]) -> int:
    """eksctl delete nodegroup --wait removes the group's stack, and with it the group."""
    name, cluster = _flag(words, "--name"), _flag(words, "--cluster")
    stack = state.get("stacks", {}).pop(f"eksctl-{cluster}-nodegroup-{name}", None)
    group = state.get("nodegroups", {}).pop(name, None)
    if stack is None and group is None:
        return _error(f"Error: nodegroup {name} not found")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))

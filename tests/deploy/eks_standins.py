"""Stand-ins for eksctl, kubectl, helm and aws: ``python eks_standins.py TOOL ARGS...``.

Each call appends {"tool", "argv", "stdin"} to $STANDIN_LOG and keeps what it "created" in the
JSON set $STANDIN_STATE, so existence checks (``eksctl get cluster``, ``helm status``, ...) answer
as a real cluster would and a re-run skips what is done. STANDIN_FAIL="helm upgrade" makes the
call whose tool is ``helm`` and whose arguments contain ``upgrade`` (in order) fail with exit 1.
No pdserve imports: it runs as a separate process, as the real tools would.
"""

from __future__ import annotations

import http.server
import json
import os
import sys
from pathlib import Path

GATEWAY_METRICS = "".join(  # as the gateway's registry writes them
    f"# TYPE {name}_total counter\n{name}_total{{endpoint=\"http://10.0.3.7:8200\"}} {value}\n"
    for name, value in (("pdserve_engine_kv_transfer_bytes", 4.0e8), ("pdserve_engine_kv_transfer_seconds", 0.2),
                        ("pdserve_engine_kv_transfers", 12.0), ("pdserve_engine_kv_transfer_failures", 0.0))
)
RAYSERVICE_READY = {"status": {
    "conditions": [{"type": "Ready", "status": "True", "reason": "RayServiceReady"}],
    "activeServiceStatus": {"applicationStatuses": {"pdserve": {"status": "RUNNING", "serveDeploymentStatuses": {
        "prefill": {"status": "HEALTHY"}, "decode": {"status": "HEALTHY"}, "gateway": {"status": "HEALTHY"}}}}},
}}
PODS = {"items": [
    {"metadata": {"name": "pdserve-head-x7"}, "spec": {"nodeName": "ip-10-0-1-5", "containers": [{}]},
     "status": {"phase": "Running", "podIP": "10.0.1.9", "containerStatuses": [{"ready": True, "restartCount": 0,
                                                                              "state": {"running": {}}}]}},
    {"metadata": {"name": "pdserve-prefill-worker-a1"}, "spec": {"nodeName": "ip-10-0-3-7", "containers": [{}]},
     "status": {"phase": "Running", "podIP": "10.0.3.7", "containerStatuses": [{"ready": True, "restartCount": 1,
                                                                              "state": {"running": {}}}]}},
]}
NODES = {"items": [
    {"metadata": {"name": "ip-10-0-1-5", "labels": {"node.kubernetes.io/instance-type": "m7i.xlarge",
                                                     "topology.kubernetes.io/zone": "us-west-2a"}},
     "status": {"capacity": {"cpu": "4"}, "conditions": [{"type": "Ready", "status": "True"}]}},
    {"metadata": {"name": "ip-10-0-3-7", "labels": {"node.kubernetes.io/instance-type": "g6.8xlarge",
                                                     "topology.kubernetes.io/zone": "us-west-2b"}},
     "status": {"capacity": {"nvidia.com/gpu": "1", "vpc.amazonaws.com/efa": "1"},
                "conditions": [{"type": "Ready", "status": "True"}]}},
]}
OFFERINGS = {"InstanceTypeOfferings": [
    {"InstanceType": "g6.8xlarge", "Location": "us-west-2d"}, {"InstanceType": "g6.8xlarge", "Location": "us-west-2b"},
    {"InstanceType": "m7i.xlarge", "Location": "us-west-2a"}, {"InstanceType": "m7i.xlarge", "Location": "us-west-2b"},
]}


def main(tool: str, argv: list[str]) -> int:
    words = _without_context(argv)
    stdin = sys.stdin.read() if "-" in argv or any("/dev/stdin" in arg for arg in argv) else ""
    with open(os.environ["STANDIN_LOG"], "a") as log:
        log.write(json.dumps({"tool": tool, "argv": argv, "words": words, "stdin": stdin}) + "\n")
    if _is_failing(tool, words):
        print(f"Error: simulated failure of {tool} {' '.join(words)}", file=sys.stderr)
        return 1
    state_path = Path(os.environ["STANDIN_STATE"])
    state = set(json.loads(state_path.read_text())) if state_path.exists() else set()
    code = answer(tool, words, stdin, state)
    state_path.write_text(json.dumps(sorted(state)))
    return code


def answer(tool: str, words: list[str], stdin: str, state: set[str]) -> int:
    """What the real tool would do, reduced to the objects ``cloud up`` makes and checks for."""
    command = " ".join([tool, *words])
    if command.startswith("aws ec2 describe-instance-type-offerings"):
        print(json.dumps(OFFERINGS))
    elif command.startswith("kubectl port-forward"):
        return _serve_gateway()
    elif tool == "kubectl" and words[:2] == ["get", "pods"]:
        print(json.dumps(PODS))
    elif tool == "kubectl" and words[:2] == ["get", "nodes"]:
        print(json.dumps(NODES))
    elif tool == "kubectl" and words[:2] == ["get", "rayservice"]:
        if "rayservice" not in state:
            print('Error from server (NotFound): rayservices.ray.io "pdserve" not found', file=sys.stderr)
            return 1
        print(json.dumps(RAYSERVICE_READY))
    elif tool == "kubectl" and words[:2] == ["apply", "-f"]:
        state.update(kind.lower() for kind in ("Namespace", "RayService", "Service") if f"kind: {kind}\n" in stdin)
    elif tool == "kubectl" and words[:2] == ["delete", "-f"]:
        state.difference_update({"namespace", "rayservice", "service", "secret"})
    else:
        return _create_get_delete(command, state)
    return 0


def _create_get_delete(command: str, state: set[str]) -> int:
    """Commands that make, look up or remove one named thing; a lookup of a missing one exits 1."""
    words = command.split()
    if command.startswith("eksctl create nodegroup"):
        state.add(f"{words[-1]}-nodes")
        return 0
    if command.startswith("eksctl get nodegroup"):
        return 0 if f"{words[words.index('--name') + 1]}-nodes" in state else 1
    things = {
        "cluster": ("eksctl create cluster", "eksctl get cluster", "eksctl delete cluster"),
        "context": ("aws eks update-kubeconfig", "kubectl config get-contexts", "kubectl config delete-context"),
        "kuberay": ("helm upgrade --install", "helm status", "helm uninstall"),
        "secret": ("kubectl create secret", "kubectl get secret", "kubectl delete secret"),
        "namespace": ("", "kubectl get namespace", ""),
    }
    for thing, (create, get, delete) in things.items():
        if create and command.startswith(create):
            state.add(thing)
            return 0
        if command.startswith(get):
            return 0 if thing in state else 1
        if delete and command.startswith(delete):
            state.difference_update({thing, "system-nodes", "gpu-nodes"} if thing == "cluster" else {thing})
            return 0
    if command.startswith("kubectl get") and "daemonset" in words:
        return 0 if "gpu-nodes" in state else 1
    if command.startswith("kubectl get crd"):
        return 1  # no Prometheus Operator
    return 0  # helm repo add, kubectl patch: nothing to remember


def _serve_gateway() -> int:
    """``kubectl port-forward``: a gateway on a free local port, announced as kubectl does."""

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self._reply(200, "ok" if self.path == "/health" else GATEWAY_METRICS, content_type="text/plain")

        def do_POST(self) -> None:
            self.rfile.read(int(self.headers["Content-Length"]))
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


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2:]))

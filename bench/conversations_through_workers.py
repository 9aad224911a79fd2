"""Multi-turn chats through one gateway worker and through several, as a load balancer spreads them
(issue "A gateway fleet"): does each conversation stay on the decode engine holding its prefix?

    .venv/bin/python bench/conversations_through_workers.py [--arm NAME=WORKERS:keepalive|new|ray ...]
        [--rounds 3] [--conversations 6] [--turns 4] [--out docs/results/conversations-through-workers]

Each arm runs on the CPU demo started afresh (1 prefill, 2 decode engines, ``routing.disaggregation:
auto``). ``WORKERS:keepalive`` and ``WORKERS:new``: `pdserve up` with ``gateway.workers: WORKERS``;
``keepalive`` keeps one connection, ``new`` opens one per request, so the kernel hands each to any
worker, as a load balancer would. ``WORKERS:ray``: `pdserve ray up` on a Ray cluster on loopback
addresses (tests/e2e/ray_cluster.py) with ``gateway.replicas: WORKERS``, one per gateway node, and
each turn of a conversation on a new connection to another replica than its turn before. Its client sends the conversations'
turns one request at a time, round-robin over the conversations, each turn carrying the replies
before it. Every conversation shares one
~3,000-character system prompt. Per run: the decode engines' own prefix-cache hit rate over the
run, and how many turn-to-turn moves changed decode engine (read from the engines' request
counters). Prints a line per run; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.config_ab import run_rounds
from bench.prefix_routing import prefix_tokens
from bench.soak import ENGINE_KEY, Deployment, start
from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve_vllm import ENGINE_KEY_ENV
from tests.conftest import free_port
from tests.e2e.ray_cluster import Node, local_cluster

ARMS = {"1 worker, keep-alive": "1:keepalive", "4 workers, new connection each": "4:new",
        "2 Ray gateway replicas, new connection each": "2:ray"}
GATEWAY_NODES = ("127.0.0.2", "127.0.0.5", "127.0.0.6", "127.0.0.7")  # the head first
PREFILL_NODE, DECODE_NODE = "127.0.0.3", "127.0.0.4"
TOPICS = ("sockets", "files", "threads", "signals", "buffers", "processes", "pipes", "timers")
EXAMPLE = ROOT / "examples" / "ray-cpu.yaml"
SYSTEM_PROMPT = " ".join(f"Section {number}: the module provides functions for reading and writing files, "
                         "sockets and other streams." for number in range(35))


def parse_arm(text: str) -> tuple[str, str]:
    name, _, how = text.partition("=")
    workers, _, connection = how.partition(":")
    if not (name and workers.isdigit() and connection in ("keepalive", "new", "ray")):
        raise argparse.ArgumentTypeError(f"an arm is NAME=WORKERS:keepalive|new|ray, not {text!r}")
    return name, how


def successes(urls: list[str]) -> list[float]:
    """Requests each engine has finished (vLLM's counter, summed over its finish reasons)."""
    return [sum(float(line.rsplit(" ", 1)[1])
                for line in httpx.get(url + "/metrics", headers=ENGINE_KEY.headers(), timeout=10).text.splitlines()
                if line.startswith("vllm:request_success_total{")) for url in urls]


def run_once(how: str, workdir: Path, *, conversations: int, turns: int) -> dict[str, Any]:
    workers, connection = how.split(":")
    with ExitStack() as stack:
        if connection == "ray":
            gateway_urls, decode_urls = stack.enter_context(ray_deployment(workdir, replicas=int(workers)))
        else:
            deployment: Deployment = start(workdir, sections={"routing": {"disaggregation": "auto"},
                                                              "gateway": {"workers": int(workers)}})
            stack.callback(deployment.stop)
            gateway_urls, decode_urls = [deployment.base_url], deployment.engine_urls[1:]
        result = converse(gateway_urls, decode_urls, keepalive=connection == "keepalive",
                          conversations=conversations, turns=turns)
    return result


@contextmanager
def ray_deployment(workdir: Path, *, replicas: int) -> Iterator[tuple[list[str], list[str]]]:
    """`pdserve ray up` of the CPU demo with 2 decode engines and ``replicas`` gateway replicas, on a
    loopback Ray cluster; yields (the gateway replicas' URLs, the decode engines' URLs)."""
    heads = GATEWAY_NODES[:replicas]
    nodes = [Node(PREFILL_NODE, {"prefill": 1}, cpus=1), Node(DECODE_NODE, {"decode": 2}, cpus=2),
             *(Node(ip, {"gateway": 1}, cpus=1) for ip in heads[1:])]
    with local_cluster(Node(heads[0], {"head": 1, "gateway": 1}, cpus=1), nodes, temp_dir=workdir / "ray") as cluster:
        config = yaml.safe_load(EXAMPLE.read_text())
        port = free_port()
        config["gateway"] = {"host": "node", "port": port, "replicas": replicas}
        config["ray"] |= {"address": cluster.dashboard_url, "gateway_resources": {"gateway": 1}}
        config["routing"] = {"disaggregation": "auto"}
        config["decode"] |= {"engines": 2, "cpu_threads_bind": ["1"]}
        config["prefill"] |= {"cpu_threads_bind": ["0"]}
        config["launch"] = {"log_dir": str(workdir / "logs")}
        (workdir / "pdserve.yaml").write_text(yaml.safe_dump(config))
        subprocess.run([sys.executable, "-m", "pdserve", "ray", "up", "--config", str(workdir / "pdserve.yaml")],
                       env=cluster.env | {ENGINE_KEY_ENV: ENGINE_KEY.value}, check=True, timeout=1500)
        gateway_urls = [f"http://{ip}:{port}" for ip in heads]
        for _ in range(120):  # every replica knows both decode engines
            known = [httpx.get(url + "/health", timeout=10).json()["engines"]["decode"] for url in gateway_urls]
            if all(len(engines) == 2 for engines in known):
                break
            time.sleep(1)
        yield gateway_urls, sorted(engine["url"] for engine in known[0])
        subprocess.run([sys.executable, "-m", "pdserve", "ray", "down", "--config", str(workdir / "pdserve.yaml")],
                       env=cluster.env, check=False, timeout=300)


def converse(gateway_urls: list[str], decode_urls: list[str], *, keepalive: bool, conversations: int,
             turns: int) -> dict[str, Any]:
    """The conversations' turns one request at a time; each turn of a conversation through the next
    of ``gateway_urls`` than its turn before."""
    chats: list[list[dict[str, str]]] = [[{"role": "system", "content": SYSTEM_PROMPT}] for _ in range(conversations)]
    served: list[list[int]] = [[] for _ in range(conversations)]
    queried_before, hit_before = prefix_tokens(decode_urls)
    with httpx.Client(timeout=120) as kept:
        for turn in range(turns):
            for index, messages in enumerate(chats):
                messages.append({"role": "user", "content": f"Question {turn} about {TOPICS[index % len(TOPICS)]} "
                                                            f"in conversation {index}?"})
                before = successes(decode_urls)
                body = {"model": DEMO_MODEL_NAME, "messages": messages, "max_tokens": 16, "temperature": 0}
                url = gateway_urls[(turn + index) % len(gateway_urls)] + "/v1/chat/completions"
                if keepalive:
                    reply = kept.post(url, json=body)
                else:
                    with httpx.Client(timeout=120) as client:
                        reply = client.post(url, json=body)
                reply.raise_for_status()
                messages.append({"role": "assistant", "content": reply.json()["choices"][0]["message"]["content"]})
                rises = [after - was for after, was in zip(successes(decode_urls), before, strict=True)]
                served[index].append(rises.index(max(rises)))
    queried, hit = prefix_tokens(decode_urls)
    moves = sum(engines[turn] != engines[turn - 1] for engines in served for turn in range(1, turns))
    return {"decode_prefix_hit_rate": round((hit - hit_before) / (queried - queried_before), 4),
            "moves": moves, "turn_to_turn": conversations * (turns - 1), "served": served,
            "load_average": round(os.getloadavg()[0], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", type=parse_arm, action="append",
                        help="NAME=WORKERS:keepalive|new|ray (default: " + ", ".join(f"{k}={v}" for k, v in ARMS.items()) + ")")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--out", type=Path, default=Path("runs/conversations-through-workers"))
    args = parser.parse_args()
    runs = run_rounds(
        dict(args.arm or ARMS.items()), rounds=args.rounds, temp_prefix="pdserve-conversations-",
        run=lambda _name, how, workdir, _round: run_once(how, workdir, conversations=args.conversations,
                                                         turns=args.turns),
        describe=lambda run: (f"decode prefix hit rate {run['decode_prefix_hit_rate']:.1%}, {run['moves']} of "
                              f"{run['turn_to_turn']} turns moved engine, load average {run['load_average']}"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "runs.json").write_text(json.dumps(runs, indent=1))
    print(json.dumps(runs))


if __name__ == "__main__":
    main()

"""How long `pdserve up` takes to be ready, for configurations side by side (issue: a fast first start).

    .venv/bin/python bench/first_start.py --arm 'fork={}' \\
        --arm 'spawn={"prefill": {"env": {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}}, "decode": {...}}' [--rounds 3]

Each --arm is NAME=JSON, a configuration tree laid over the demo's defaults (bench/config_ab.py's
form), run on free ports with its own log folder. Per round, each arm in the order given: `pdserve up`
until its ready line, one completion through the gateway, then Ctrl-C. Prints per run the ready
time, each engine's, the completion's text and the load average; the last line is JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.config_ab import ENGINE_READY, machine_line, parse_arm
from pdserve.engine_config import DEMO_MODEL_NAME
from tests.conftest import free_port_block

READY = re.compile(r"ready in (\d+)s")
READY_TIMEOUT_S = 600.0


def run_once(tree: dict[str, Any], workdir: Path) -> dict[str, Any]:
    base = free_port_block(5)
    ports = {"gateway": {"port": base}, "prefill": {"base_port": base + 1}, "decode": {"base_port": base + 2},
             "kv": {"side_channel_base_port": base + 3}, "launch": {"log_dir": str(workdir / "logs")}}
    config = {name: {**section, **tree.get(name, {})} for name, section in ports.items()} | {
        name: section for name, section in tree.items() if name not in ports}
    (workdir / "pdserve.yaml").write_text(yaml.safe_dump(config))
    process = subprocess.Popen([sys.executable, "-m", "pdserve", "up", "--config", str(workdir / "pdserve.yaml")],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    deadline_s = time.monotonic() + READY_TIMEOUT_S
    try:
        assert process.stdout is not None
        for line in process.stdout:
            lines.append(line)
            if READY.search(line) or time.monotonic() > deadline_s:
                break
        ready = [match for line in lines if (match := READY.search(line))]
        if not ready:
            raise SystemExit("pdserve up never became ready:\n" + "".join(lines[-20:]))
        reply = httpx.post(f"http://127.0.0.1:{base}/v1/completions", timeout=60, json={
            "model": DEMO_MODEL_NAME, "prompt": "The file", "max_tokens": 8, "temperature": 0})
        reply.raise_for_status()
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=120)
    engines = {match[1]: int(match[2]) for line in lines if (match := ENGINE_READY.match(line))}
    return {"ready_s": int(ready[0][1]), "engines_ready_s": engines, "text": reply.json()["choices"][0]["text"],
            "load_average": round(os.getloadavg()[0], 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", type=parse_arm, action="append", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(machine_line(), flush=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name, _ in args.arm}
    for round_number in range(1, args.rounds + 1):
        for name, tree in args.arm:
            with tempfile.TemporaryDirectory(prefix="pdserve-first-start-") as workdir:
                run = run_once(tree, Path(workdir))
            runs[name].append(run)
            print(f"round {round_number} {name}: ready in {run['ready_s']} s (engines {run['engines_ready_s']}), "
                  f"text {run['text']!r}, load average {run['load_average']}", flush=True)
    print(json.dumps(runs))


if __name__ == "__main__":
    main()

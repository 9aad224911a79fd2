"""Two or more configurations of the CPU demo side by side, engines started afresh for each run (docs/transport.md, section 6).

    .venv/bin/python bench/config_ab.py --arm 'pause 0={"kv": {"progress_delay_us": 0}}' --arm 'pause 100={}' \\
        [--rounds 2] [--rate 1,2,4] [--duration 20]

Each --arm is NAME=JSON, a configuration tree laid over the demo's defaults. Per round, each arm in
the order given: `pdserve bench compare --ways disaggregated` on it. Prints each run's time to
ready, its table rows and the load average after it; the raw results go under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import yaml

from pdserve.bench.machine import machine_state

T = TypeVar("T")
ENGINE_READY = re.compile(r"\s*(\S+)\s+ready\s+(\d+)s")  # `bench compare`'s line as each engine answers


def run_once(name: str, tree: dict[str, Any], *, rate: str, duration: float, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    config = out / "pdserve.yaml"
    config.write_text(yaml.safe_dump(tree))
    result = subprocess.run([sys.executable, "-m", "pdserve", "bench", "compare", "--config", str(config),
                             "--ways", "disaggregated", "--rate", rate, "--duration", str(duration), "--out", str(out)],
                            check=True, capture_output=True, text=True)
    lines = result.stdout.splitlines()
    ready = [match for line in lines if (match := ENGINE_READY.match(line))]
    summary = [line for line in lines if ENGINE_READY.match(line) or line.startswith(("KV handoff", "|"))]
    (out / "summary.txt").write_text("\n".join(summary) + "\n")
    rows = [line for line in summary if line.startswith("| disaggregated")]
    return [f"{name}: ready " + ", ".join(f"{match[1]} {match[2]} s" for match in ready), *rows]


def machine_line() -> str:
    """What a run's figures rest on, printed first: the CPU, its cores and the load average."""
    state = machine_state()
    return f"{state['cpu_model']}, {state['cpus']} cores, load average {state['load_average'][0]:.1f} at the start"


def run_rounds(arms: dict[str, T], *, rounds: int, temp_prefix: str, run: Callable[[str, T, Path, int], dict[str, Any]],
               describe: Callable[[dict[str, Any]], str]) -> dict[str, list[dict[str, Any]]]:
    """Per round, each arm in order, each in a temporary directory of its own (``run(name, arm, workdir,
    round_number)``); prints the machine first, then one line per run. Returns each arm's runs."""
    print(machine_line(), flush=True)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in arms}
    for round_number in range(1, rounds + 1):
        for name, arm in arms.items():
            with tempfile.TemporaryDirectory(prefix=temp_prefix) as workdir:
                result = run(name, arm, Path(workdir), round_number)
            runs[name].append(result)
            print(f"round {round_number} {name}: {describe(result)}", flush=True)
    return runs


def parse_arm(text: str) -> tuple[str, dict[str, Any]]:
    name, _, tree = text.partition("=")
    parsed = json.loads(tree or "{}")
    if not name or not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"an arm is NAME=JSON object, not {text!r}")
    return name, parsed


def add_run_options(parser: argparse.ArgumentParser, *, rate: str, duration: float, out: str) -> None:
    """The options every side-by-side run of the demo takes: rounds, its load, where results go."""
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--rate", default=rate)
    parser.add_argument("--duration", type=float, default=duration)
    parser.add_argument("--out", type=Path, default=Path(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arm", type=parse_arm, action="append", required=True)
    add_run_options(parser, rate="1,2,4", duration=20.0, out="runs/config-ab")
    args = parser.parse_args()
    print(machine_line(), flush=True)
    for round_number in range(1, args.rounds + 1):
        for index, (name, tree) in enumerate(args.arm):
            lines = run_once(name, tree, rate=args.rate, duration=args.duration,
                             out=args.out / f"round{round_number}-arm{index + 1}")
            print("\n".join(lines), f"\nload average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()

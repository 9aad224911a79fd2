"""NIXL's progress thread with no pause (NIXL's own) against pdserve's pause, on the CPU demo (docs/transport.md, section 6).

    .venv/bin/python bench/progress_pause_ab.py [--rounds 2] [--pauses 0,100] [--rate 1,2,4] [--duration 20]

Per round, for each pause in turn: `pdserve bench compare --ways disaggregated` on the demo with
`kv.progress_delay_us` set to it, its engines started afresh. Prints each run's time to ready, its
table rows and the load average after it; the raw results go under --out.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import yaml


def run_once(pause_us: int, *, rate: str, duration: float, out: Path) -> list[str]:
    out.mkdir(parents=True, exist_ok=True)
    config = out / "pdserve.yaml"
    config.write_text(yaml.safe_dump({"kv": {"progress_delay_us": pause_us}}))
    result = subprocess.run([sys.executable, "-m", "pdserve", "bench", "compare", "--config", str(config),
                             "--ways", "disaggregated", "--rate", rate, "--duration", str(duration), "--out", str(out)],
                            check=True, capture_output=True, text=True)
    (out / "output.txt").write_text(result.stdout + result.stderr)
    ready = re.findall(r"^\s*(\S+)\s+ready\s+(\d+)s", result.stdout, re.MULTILINE)
    rows = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| disaggregated")]
    return [f"pause {pause_us} us: ready " + ", ".join(f"{name} {seconds} s" for name, seconds in ready), *rows]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--pauses", default="0,100", help="pauses in microseconds, in the order run each round")
    parser.add_argument("--rate", default="1,2,4")
    parser.add_argument("--duration", type=float, default=20.0)
    parser.add_argument("--out", type=Path, default=Path("runs/progress-pause-ab"))
    args = parser.parse_args()
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, "
          f"load average {os.getloadavg()[0]:.1f} at the start", flush=True)
    for round_number in range(1, args.rounds + 1):
        for pause_us in (int(pause) for pause in args.pauses.split(",")):
            lines = run_once(pause_us, rate=args.rate, duration=args.duration,
                             out=args.out / f"round{round_number}-pause{pause_us}")
            print("\n".join(lines), f"\nload average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()

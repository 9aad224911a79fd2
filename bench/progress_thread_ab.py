"""NIXL's spinning progress thread at normal against lowest priority, on a running CPU demo (docs/transport.md, 6).

    .venv/bin/pdserve up &      # once ready: it lowers each engine's spinning thread itself
    .venv/bin/python bench/progress_thread_ab.py [--rounds 2] [--duration 30] [--concurrency 1,4]

Finds the engine threads `pdserve up` lowered to the lowest priority, then alternates: the same
`pdserve bench run` with those threads at nice 0, then at nice 19, round after round. Leaves them
at 19. Prints each run's table rows, the load average after each run and the CPU model.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from pdserve.engines.cpu_affinity import LOWEST_PRIORITY, WORKER_NAME

PROC = Path("/proc")


def lowered_threads() -> list[int]:
    """Threads of vLLM worker processes running at the lowest priority."""
    found = []
    for process in PROC.glob("[0-9]*"):
        try:
            if (process / "comm").read_text().strip() != WORKER_NAME:
                continue
            found += [int(task.name) for task in (process / "task").glob("[0-9]*")
                      if os.getpriority(os.PRIO_PROCESS, int(task.name)) == LOWEST_PRIORITY]
        except OSError:
            continue
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway-url", default="http://127.0.0.1:8000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--out", type=Path, default=Path("runs/progress-thread-ab"))
    args = parser.parse_args()
    threads = lowered_threads()
    if not threads:
        raise SystemExit("no engine thread at the lowest priority: is `pdserve up` (CPU engines) running?")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; threads {threads}")
    for round_number in range(1, args.rounds + 1):
        for nice in (0, LOWEST_PRIORITY):
            for thread_id in threads:
                os.setpriority(os.PRIO_PROCESS, thread_id, nice)
            out = args.out / f"round{round_number}-nice{nice}"
            subprocess.run([sys.executable, "-m", "pdserve", "bench", "run", "-t", f"nice{nice}={args.gateway_url}",
                            "--concurrency", args.concurrency, "--duration", str(args.duration),
                            "--output-tokens", "64", "--out", str(out)], check=True, capture_output=True)
            rows = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| nice")]
            print("\n".join(rows), f"\nload average {os.getloadavg()[0]:.1f}", flush=True)


if __name__ == "__main__":
    main()

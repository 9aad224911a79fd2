"""NIXL's spinning progress thread at normal against lowest priority, on a running CPU demo (docs/transport.md, "Open").

    .venv/bin/pdserve up &      # once ready, with the engines idle:
    .venv/bin/python bench/progress_thread_ab.py [--rounds 2] [--duration 30] [--concurrency 1,4]

Finds each engine's progress thread (a thread of a vLLM worker process, not its model thread,
that spins more than half a core, mostly in the kernel, while the engines idle), then alternates
the same `pdserve bench run` with those threads at nice 0 and at nice 19, round after round, and
leaves them at 0. Prints each run's table rows and the load average after it.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

PROC = Path("/proc")
WORKER_NAME = "VLLM::Worker"
LOWEST_PRIORITY = 19


def worker_thread_ticks() -> dict[int, tuple[int, int]]:
    """(user, system) clock ticks of every non-main thread of every vLLM worker process."""
    ticks = {}
    for process in PROC.glob("[0-9]*"):
        try:
            if (process / "comm").read_text().strip() != WORKER_NAME:
                continue
            for task in (process / "task").glob("[0-9]*"):
                fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
                if task.name != process.name:
                    ticks[int(task.name)] = (int(fields[11]), int(fields[12]))
        except OSError:
            continue
    return ticks


def spinning_threads(window_s: float = 3.0) -> list[int]:
    before = worker_thread_ticks()
    time.sleep(window_s)
    ticks_per_s = os.sysconf("SC_CLK_TCK")
    found = []
    for thread_id, (user, system) in worker_thread_ticks().items():
        if thread_id in before:
            user_ticks, system_ticks = user - before[thread_id][0], system - before[thread_id][1]
            if (user_ticks + system_ticks) / ticks_per_s > window_s / 2 and system_ticks > user_ticks:
                found.append(thread_id)
    return found


def set_priority(threads: list[int], nice: int) -> None:
    for thread_id in threads:
        os.setpriority(os.PRIO_PROCESS, thread_id, nice)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway-url", default="http://127.0.0.1:8000")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--duration", type=float, default=30.0)
    parser.add_argument("--concurrency", default="1,4")
    parser.add_argument("--out", type=Path, default=Path("runs/progress-thread-ab"))
    args = parser.parse_args()
    threads = spinning_threads()
    if not threads:
        raise SystemExit("no spinning engine thread found: is `pdserve up` (CPU engines) running and idle?")
    print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; threads {threads}")
    try:
        for round_number in range(1, args.rounds + 1):
            for nice in (0, LOWEST_PRIORITY):
                set_priority(threads, nice)
                out = args.out / f"round{round_number}-nice{nice}"
                subprocess.run([sys.executable, "-m", "pdserve", "bench", "run", "-t", f"nice{nice}={args.gateway_url}",
                                "--concurrency", args.concurrency, "--duration", str(args.duration),
                                "--output-tokens", "64", "--out", str(out)], check=True, capture_output=True)
                rows = [line for line in (out / "results.md").read_text().splitlines() if line.startswith("| nice")]
                print("\n".join(rows), f"\nload average {os.getloadavg()[0]:.1f}", flush=True)
    finally:
        set_priority(threads, 0)


if __name__ == "__main__":
    main()

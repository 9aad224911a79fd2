"""How long the other processes on a host wait for a CPU while its CPU engines decode (docs/reliability.md).

A thread here sleeps 10 ms at a time while ``--streams`` long streams run through the gateway, and reads how
long it then waited on the run queue (the second field of /proc/self/task/<tid>/schedstat: runnable, not run).
A gateway, a health probe or a client on such a host waits as long.

    .venv/bin/python bench/run_queue_waits.py --gateway http://127.0.0.1:8000 --batches 3 --out waits.json

``--engine-pids`` with ``--autogroup-nice N`` runs the batches in pairs, side by side on the same engines: one as
they are, then one with each engine's scheduling group (its session's autogroup, /proc/<pid>/autogroup) at nice N,
set back to 0 after it (root only: lowering an autogroup's nice needs CAP_SYS_NICE).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

SLEEP_S = 0.01
PROMPT = "The module provides functions for reading and writing files, sockets and other streams. " * 3


def run_queue_s() -> float:
    """Seconds this thread has waited on a run queue, runnable, since it started."""
    with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as stats:
        return int(stats.read().split()[1]) / 1e9


def stream(gateway: str, model: str, max_tokens: int) -> int:
    """One greedy streamed completion of ``max_tokens``; the events read."""
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.stream("POST", gateway + "/v1/completions", json=body, timeout=600) as reply:
        reply.raise_for_status()
        return sum(line.startswith("data: {") for line in reply.iter_lines())


def batch(args: argparse.Namespace) -> dict[str, Any]:
    """``args.streams`` streams at once; each wait of the sleeping thread longer than 0.1 s, and the longest."""
    waits: list[float] = []
    done = threading.Event()

    def sleeper() -> None:
        while not done.is_set():
            before_s = run_queue_s()
            time.sleep(SLEEP_S)
            waits.append(run_queue_s() - before_s)

    thread = threading.Thread(target=sleeper)
    started_s = time.monotonic()
    thread.start()
    with ThreadPoolExecutor(args.streams) as pool:
        events = list(pool.map(lambda _: stream(args.gateway, args.model, args.max_tokens), range(args.streams)))
    done.set()
    thread.join()
    return {"wall_s": round(time.monotonic() - started_s, 2), "events": events,
            "longest_wait_s": round(max(waits), 3), "waits_over_100ms_s": [round(w, 3) for w in waits if w > 0.1]}


def set_autogroup_nice(pids: list[int], nice: int) -> None:
    """Every process in each pid's session shares its autogroup: one write per engine."""
    for pid in pids:
        Path(f"/proc/{pid}/autogroup").write_text(str(nice))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gateway", required=True, help="the gateway's base URL")
    parser.add_argument("--model", default="pdserve-demo")
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=3968)
    parser.add_argument("--batches", type=int, default=3)
    parser.add_argument("--engine-pids", type=int, nargs="*", default=[],
                        help="the engines' API server pids, for the side-by-side pairs")
    parser.add_argument("--autogroup-nice", type=int, default=10, help="the engines' autogroup nice in each pair's second batch")
    parser.add_argument("--out", type=Path, help="the raw results, as JSON")
    args = parser.parse_args()
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    batches: list[dict[str, Any]] = []
    results = {"cpu": cpu, "cores": os.cpu_count(), "kernel": platform.release(), "batches": batches}
    nices: list[int | None] = [0, args.autogroup_nice] if args.engine_pids else [None]
    try:
        for index in range(args.batches):
            for nice in nices:
                if nice is not None:
                    set_autogroup_nice(args.engine_pids, nice)
                result = batch(args) | {"load_average": os.getloadavg()[0], "engines_autogroup_nice": nice}
                batches.append(result)
                print(f"batch {index}{'' if nice is None else f' (engines at autogroup nice {nice})'}: {args.streams} "
                      f"streams of {args.max_tokens} tokens in {result['wall_s']} s; longest run-queue wait "
                      f"{result['longest_wait_s']} s; load average {result['load_average']:.1f}", flush=True)
                if args.out:  # after each batch: a run cut short keeps what it measured
                    args.out.write_text(json.dumps(results, indent=1) + "\n")
    finally:  # the engines as they were, also when the run is cut short
        if args.engine_pids:
            set_autogroup_nice(args.engine_pids, 0)
    print(f"{cpu}, {os.cpu_count()} cores, kernel {platform.release()}")


if __name__ == "__main__":
    main()

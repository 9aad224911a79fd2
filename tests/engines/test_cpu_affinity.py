"""Confining a CPU engine's threads, against a real process tree on this machine."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from pdserve.engines.cpu_affinity import confine_engine, parse_cpu_list

# A stand-in engine core, as vLLM-CPU leaves it: its model thread pinned to the last core.
STRAY_WORKER = """
import os, sys, time
os.sched_setaffinity(0, {max(os.sched_getaffinity(0))})
print("ready", flush=True)
time.sleep(30)
"""


def test_cpu_lists_parse_like_vllm_and_taskset() -> None:
    assert parse_cpu_list("0,2-3") == {0, 2, 3}
    assert parse_cpu_list("0-1|4-5") == {0, 1, 4, 5}
    assert parse_cpu_list("auto") == set() and parse_cpu_list("nobind") == set()


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two cores to move a thread between")
def test_a_thread_pinned_outside_its_engines_cores_is_moved_back() -> None:
    own_core = min(os.sched_getaffinity(0))
    # The engine is a shell whose child is the worker, as vLLM's API server parents its engine core.
    engine = subprocess.Popen(["/bin/sh", "-c", '"$0" -c "$1"; true', sys.executable, STRAY_WORKER],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None and engine.stdout.readline() == "ready\n"
        worker = next(pid for pid in _children(engine.pid))
        assert os.sched_getaffinity(worker) != {own_core}
        moved = confine_engine(engine.pid, {own_core})
        assert worker in moved and os.sched_getaffinity(worker) == {own_core}
        assert os.sched_getaffinity(engine.pid) == {own_core}  # the engine's own process too
        assert confine_engine(engine.pid, {own_core}) == []  # nothing left outside
    finally:
        subprocess.run(["pkill", "-P", str(engine.pid)], check=False)
        engine.kill()
        engine.wait()


def _children(pid: int) -> list[int]:
    for _ in range(50):
        found = [int(p) for p in os.listdir("/proc") if p.isdigit() and _ppid(int(p)) == pid]
        if found:
            return found
        time.sleep(0.05)
    return []


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return int(stat.read().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None

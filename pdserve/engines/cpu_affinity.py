"""Keep every thread of a CPU engine on the engine's own cores.

pdserve starts a CPU engine with its process affinity set to its cores (engines/launcher.py), and
all its processes and threads inherit it. One thread escapes: vLLM-CPU's NIXL connector (0.32)
pins the thread that sets it up, the model thread, to the last core of each NUMA node, meant for
KV transfers. With two engines on a host both model threads then share that one core. On the
2-core demo, moving the prefill engine's model thread back to its own core took PD TTFT p50
from 557 to 64 ms (docs/transport.md). Linux only; elsewhere there is nothing to undo.
"""

from __future__ import annotations

import os
from collections import defaultdict
from pathlib import Path

_PROC = Path("/proc")


def parse_cpu_list(text: str) -> set[int]:
    """``"0,2-3"`` -> {0, 2, 3}, in VLLM_CPU_OMP_THREADS_BIND's syntax (``|`` between ranks
    counts as a comma); vLLM's words ``auto`` and ``nobind`` name no cores: empty set."""
    if text in ("auto", "nobind"):
        return set()
    cores: set[int] = set()
    for part in filter(None, text.replace("|", ",").split(",")):
        first, _, last = part.partition("-")
        cores.update(range(int(first), int(last or first) + 1))
    return cores


def confine_engine(root_pid: int, cores: set[int]) -> list[int]:
    """Move every thread of ``root_pid`` and its descendants that runs outside ``cores`` onto
    them; returns the ids of the threads moved. Threads that exit meanwhile are skipped."""
    if not cores or not hasattr(os, "sched_setaffinity"):
        return []
    moved = []
    for pid in _descendants(root_pid):
        for task in (_PROC / str(pid) / "task").glob("[0-9]*"):
            thread_id = int(task.name)
            try:
                if not os.sched_getaffinity(thread_id) <= cores:
                    os.sched_setaffinity(thread_id, cores)
                    moved.append(thread_id)
            except (ProcessLookupError, PermissionError):
                continue
    return moved


def _descendants(root_pid: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for stat in _PROC.glob("[0-9]*/stat"):
        text = _read(stat)
        if text:  # "pid (comm) state ppid ...", and comm may hold spaces or parentheses
            children[int(text.rsplit(")", 1)[1].split()[1])].append(int(stat.parent.name))
    found, pending = [], [root_pid]
    while pending:
        pid = pending.pop()
        found.append(pid)
        pending.extend(children.get(pid, []))
    return found


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:  # the process exited while we looked
        return ""

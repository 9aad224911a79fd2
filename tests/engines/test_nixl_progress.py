"""The pause pdserve gives NIXL's progress thread (pdserve_vllm), on NIXL's real bindings."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from pdserve_vllm import pause_progress_thread

IDLE_CPU = Path(__file__).parents[2] / "bench" / "nixl_idle_cpu.py"


def test_every_agent_made_afterwards_gets_the_pause() -> None:
    made: list[tuple[str, Any]] = []
    bindings = SimpleNamespace(nixlAgent=lambda name, config: made.append((name, config)) or name)
    pause_progress_thread(bindings, 100)
    assert bindings.nixlAgent("a", SimpleNamespace(pthrDelay=0)) == "a"
    assert [(name, config.pthrDelay) for name, config in made] == [("a", 100)]


def idle_cpu(*args: str) -> float:
    """The share of a core one idle NIXL agent (UCX, vLLM's settings) kept busy over 2 s."""
    result = subprocess.run([sys.executable, str(IDLE_CPU), "--seconds", "2", *args],
                            capture_output=True, text=True, timeout=120, check=True)
    match = re.search(r"idle CPU (\d+)% of a core", result.stdout)
    assert match, result.stdout + result.stderr
    return int(match.group(1)) / 100


def test_a_paused_progress_thread_idles_where_nixls_own_spins_a_core() -> None:
    assert idle_cpu() > 0.5  # NIXL's own: no pause
    assert idle_cpu("--pause-us", "100") < 0.2

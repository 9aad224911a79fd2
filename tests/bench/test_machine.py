"""A benchmark's machine record names the CPU model, not only the architecture platform.processor() gives."""

from __future__ import annotations

from pathlib import Path

from pdserve.bench.machine import cpu_model, machine_state


def test_the_cpu_model_is_procs_model_name_and_the_state_has_the_load_average() -> None:
    names = [line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
             if line.startswith("model name")]
    assert cpu_model() == names[0]
    state = machine_state()
    assert state["cpu_model"] == names[0] and len(state["load_average"]) == 3 and state["cpus"] >= 1

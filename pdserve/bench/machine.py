"""What a benchmark's figures rest on: the CPU model, its cores, the load average and the time. No I/O but /proc."""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path
from typing import Any


def cpu_model() -> str:
    """The CPU's model name as /proc/cpuinfo gives it (platform.processor() is often only 'x86_64')."""
    cpuinfo = Path("/proc/cpuinfo")
    lines = cpuinfo.read_text().splitlines() if cpuinfo.exists() else []
    return next((line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")),
                platform.processor() or platform.machine())


def machine_state() -> dict[str, Any]:
    """The machine now: CPU model, cores, the 1/5/15-minute load averages and the date, for a raw file."""
    return {"cpu_model": cpu_model(), "cpus": os.cpu_count(), "load_average": os.getloadavg(),
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z")}

"""Renderer of `bench/first_start.py` output (benchmarks.md section 9, README): `pdserve up`'s time to ready per arm."""

from __future__ import annotations

import json
from pathlib import Path

from bench.report.raw import read_text
from bench.report.tables import Renderer, span


def ready_by_arm(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline, ``FILE``: each arm's ready times over its rounds, from the file's last JSON line (its last run)."""
    last = [line for line in read_text(results_dir / args[0]).splitlines() if line.startswith("{")][-1]
    arms: dict[str, list[dict[str, float]]] = json.loads(last)
    parts = [f"{arm} {span([r['ready_s'] for r in rounds], 0)} s" for arm, rounds in arms.items()]
    loads = [r["load_average"] for rounds in arms.values() for r in rounds]
    rounds = len(next(iter(arms.values())))
    return f"ready in {' against '.join(parts)} ({rounds} rounds, load average {span(loads, 1)})"


RENDERERS: dict[str, Renderer] = {"first_start_ready": ready_by_arm}

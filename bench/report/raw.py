"""Read the raw files the bench scripts wrote (results.json, kv-rate.json, logs, their .gz and .tgz); no rendering."""

from __future__ import annotations

import gzip
import json
import re
import tarfile
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

_KV_WINDOW = re.compile(r"(\d\d-\d\d \d\d:\d\d:\d\d) \[metrics\.py:\d+\] KV Transfer metrics: Num successful "
                        r"transfers=(\d+), .*?Avg MB per transfer=([\d.]+), Throughput \(MB/s\)=([\d.]+)")
_GATEWAY_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),\d+ INFO pdserve\.gateway\.relay: request_id=(\S+)",
                           re.MULTILINE)


@dataclass(frozen=True, slots=True)
class KvWindow:
    """One "KV Transfer metrics" line of a vLLM engine log (nixl/stats.py); vLLM's MB are MiB."""

    logged_at: str  # "MM-DD HH:MM:SS", the engine's clock
    transfers: int
    size_bytes: float
    transfer_s: float


def read_text(path: Path) -> str:
    """A text file, or its ``.gz`` beside it when only that exists."""
    zipped = path.with_name(path.name + ".gz")
    if path.exists() or not zipped.exists():
        return path.read_text(errors="replace")
    return gzip.decompress(zipped.read_bytes()).decode(errors="replace")


def read_json(path: Path) -> Any:
    return json.loads(read_text(path))


def bench_rows(folder: Path) -> list[dict[str, Any]]:
    """The rows of a `pdserve bench run` results.json, each with its load level under ``level``."""
    results = read_json(folder / "results.json")
    return [{**row, "level": row[results["load"]]} for row in results["results"]]


def metric_sum(text: str, prefix: str, label: str = "") -> float:
    """The sum of the Prometheus series whose line starts with ``prefix`` and whose labels hold ``label``."""
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(prefix) and label in line)


def archived_text(archive: Path, member: str) -> str:
    with tarfile.open(archive) as tar:
        extracted = tar.extractfile(member)
        assert extracted is not None, f"{member} in {archive} is not a file"
        return extracted.read().decode(errors="replace")


def kv_windows(log_text: str) -> list[KvWindow]:
    """The log's KV windows with at least one transfer, in order."""
    windows = []
    for logged_at, count, avg_mb, mb_per_s in _KV_WINDOW.findall(log_text):
        if int(count) and float(mb_per_s):
            size_bytes = int(count) * float(avg_mb) * 2**20
            windows.append(KvWindow(logged_at, int(count), size_bytes, size_bytes / (float(mb_per_s) * 2**20)))
    return windows


def gateway_request_times(up_log: str) -> list[tuple[datetime, str]]:
    """When the gateway logged each request's end, with its request id, in order."""
    return [(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S"), request_id)
            for stamp, request_id in _GATEWAY_LINE.findall(up_log)]

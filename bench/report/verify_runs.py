"""Renderers of `pdserve verify` runs (transport.md, benchmarks.md section 5): the rates its tables printed."""

from __future__ import annotations

from pathlib import Path

from bench.report.raw import read_text
from bench.report.tables import Renderer, span, table


def _rows(folder: Path, link: str, transport: str, pattern: str = "*verify*.txt") -> list[dict[str, str]]:
    """Every verify table row of the folder's files matching ``pattern`` on ``link`` naming ``transport``."""
    rows = []
    paths = sorted(folder.glob(pattern))
    assert paths, f"no file matches {folder}/{pattern}"
    for path in paths:
        header: list[str] = []
        for line in read_text(path).splitlines():
            if line.startswith("PREFILL "):
                header = line.split()
            elif (header and len(cells := line.split()) >= len(header) and cells[0].startswith("http") and cells[1].startswith("http")
                  and link in cells[2] and transport in line):
                # TRANSPORTS may hold spaces ("cuda_ipc/cuda (zero-copy)"): read the last columns from the right
                rows.append({**dict(zip(header[::-1], cells[::-1], strict=False)), "LINK": cells[2]})
    return rows


def same_gpu_cuda_ipc(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the engine's own KV rate of every same-GPU cuda_ipc verify row in ``folders``, with their KV sizes."""
    rows = [row for folder in folders for row in _rows(results_dir / folder, "same-gpu", "cuda_ipc")]
    rates = [float(row["ENGINE_GB/s"]) for row in rows]
    sizes = [float(row["KV_MB"]) for row in rows]
    return f"{span(rates, 0, ' GB/s')} measured for {span(sizes, 0, ' MB')} handoffs ({len(rows)} runs of `verify`)"


def verdicts(results_dir: Path, args: tuple[str, ...]) -> str:
    """Inline: how many pairs the files (one pattern under docs/results/) found OK, and the engine's KV rates."""
    folder, _, pattern = args[0].rpartition("/")
    rows = _rows(results_dir / folder, "", "", pattern)
    passed = sum(row["STATUS"] == "OK" for row in rows)
    rates = [float(row["ENGINE_GB/s"]) for row in rows]
    return f"{passed} of {len(rows)} OK, the engine's KV rate {span(rates, 1, ' GB/s')}"


def verify_table(results_dir: Path, args: tuple[str, ...]) -> str:
    """One row per file pattern under docs/results/: its runs' verdicts and rates, in file name order."""
    rows = []
    for pattern in args:
        folder, _, files = pattern.rpartition("/")
        found = _rows(results_dir / folder, "", "", files)
        statuses = [row["STATUS"] for row in found]
        rows.append([f"[`{pattern}`](results/{folder}/)", str(len(found)),
                     ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses)),
                     ", ".join(row["ENGINE_GB/s"] for row in found), ", ".join(row["HANDOFF_GB/s"] for row in found),
                     ", ".join(dict.fromkeys(f"{row['LINK']} {row['EXPECTED_GB/s']}" for row in found)),
                     ", ".join(dict.fromkeys(row["KV_MB"] for row in found)),
                     ", ".join(dict.fromkeys(row["PD==LOCAL"] for row in found))])
    header = ["raw", "runs", "verdicts", "KV moved, engine's own time (GB/s)", "handoff: bytes / decode leg (GB/s)",
              "link judged against (GB/s)", "KV MB", "PD == local"]
    return table(header, rows)


RENDERERS: dict[str, Renderer] = {"verify_same_gpu_cuda_ipc": same_gpu_cuda_ipc, "verify_verdicts": verdicts,
                                  "verify_table": verify_table}

"""Every figure between render markers in README.md and docs/*.md is what bench/report renders from docs/results/.

A changed raw file or a hand-edited figure without a re-render (`python -m bench.report`) fails here.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from bench.report.blocks import find_blocks
from bench.report.render import doc_paths, stale_blocks

REPO = Path(__file__).parents[2]
RESULTS = REPO / "docs" / "results"
BENCHMARKS = REPO / "docs" / "benchmarks.md"
README = REPO / "README.md"
SWEEP = "h200-side-by-side/reference/bench"  # the reference's synthetic sweep, benchmarks.md section 5


def test_every_rendered_block_matches_its_raw_files() -> None:
    stale = [str(entry) for doc in doc_paths(REPO) for entry in stale_blocks(doc, RESULTS)]
    assert stale == []


def test_docs_hold_rendered_blocks() -> None:
    names = {block.name for doc in doc_paths(REPO) for block in find_blocks(doc.read_text())}
    assert {"sweep_table", "versus_table", "split_table", "netbed_link_table"} <= names


def _copy_raw(tmp_path: Path) -> Path:
    """A copy of docs/results/ to edit (about 14 MB)."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    return results


def test_a_changed_raw_number_fails_the_check(tmp_path: Path) -> None:
    results = _copy_raw(tmp_path)
    path = results / SWEEP / "results.json"
    raw = json.loads(path.read_text())
    raw["results"][0]["ttft_ms"]["p50"] += 100.0  # the reference's TTFT p50 at 2 req/s: 218.2 -> 318.2 ms
    path.write_text(json.dumps(raw))
    stale = stale_blocks(BENCHMARKS, results)
    assert {"ratio_ttft_p50", "sweep_table"} <= {entry.name for entry in stale}  # the summary's ratio, section 5's table
    lines = BENCHMARKS.read_text().splitlines()
    assert all(SWEEP in lines[entry.line - 1] for entry in stale)  # only blocks that read the changed file


def test_a_changed_raw_number_fails_the_readme_that_shows_it(tmp_path: Path) -> None:
    results = _copy_raw(tmp_path)
    path = results / "gateway-overhead-16-cores" / "sweep-512-1536-streams-8-workers.txt"
    lines = path.read_text().splitlines()
    points = json.loads(lines[-1])
    points["points"][1]["gateway_cpu_us_per_chunk"] = 19.8  # 1,024 streams: 29.8 -> 19.8 µs per chunk
    path.write_text("\n".join([*lines[:-1], json.dumps(points)]))
    assert [entry.name for entry in stale_blocks(README, results)] == ["overhead_point"]
    assert [entry.name for entry in stale_blocks(README, RESULTS)] == []


def test_a_hand_edited_figure_fails_the_check(tmp_path: Path) -> None:
    text = BENCHMARKS.read_text()
    row = next(line for line in text.splitlines() if line.startswith("| reference | 2 |") and SWEEP in line)
    doc = tmp_path / "benchmarks.md"
    doc.write_text(text.replace(row, row.replace("218.2", "118.2")))
    assert [entry.name for entry in stale_blocks(doc, RESULTS)] == ["sweep_table"]
    assert stale_blocks(BENCHMARKS, RESULTS) == []

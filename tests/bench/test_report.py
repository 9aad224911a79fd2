"""The report files: a JSON with every figure, a markdown table, a PNG."""

from __future__ import annotations

import json
from pathlib import Path

from pdserve.bench.points import Point
from pdserve.bench.report import to_markdown, write_report
from pdserve.bench.stats import Percentiles, Summary

SUMMARY = Summary(
    requests=10, errors=1, duration_s=5.0, request_rate=1.8, output_tokens_per_s=120.0, goodput=1.2,
    slo_attainment=0.6, ttft_ms=Percentiles(10.0, 20.0, 30.0), itl_ms=Percentiles(1.0, 2.0, 3.0), tpot_ms=None,
    e2e_ms=Percentiles(100.0, 200.0, 300.0),
)
POINTS = [Point("direct", 1.0, SUMMARY), Point("direct", 2.0, SUMMARY), Point("gateway", 1.0, SUMMARY)]


def test_markdown_has_one_row_per_target_and_level() -> None:
    table = to_markdown(POINTS, load_name="rate").splitlines()
    assert len(table) == 2 + len(POINTS)
    assert table[2].startswith("| direct | 1 | 1.80 | 120 | 10.0 / 20.0 / 30.0 | 1.0 / 2.0 / 3.0 | - | 1.20 | 60% | 1 |")


def test_report_writes_json_markdown_and_png(tmp_path: Path) -> None:
    paths = write_report(POINTS, out_dir=tmp_path, load_name="rate", meta={"command": ["x"]}, title="t")
    json_path, markdown_path, png_path = paths
    results = json.loads(json_path.read_text())["results"]
    assert [(row["target"], row["rate"]) for row in results] == [("direct", 1.0), ("direct", 2.0), ("gateway", 1.0)]
    assert results[0]["ttft_ms"] == {"p50": 10.0, "p90": 20.0, "p99": 30.0}
    assert markdown_path.read_text().startswith("| target |")
    assert png_path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"

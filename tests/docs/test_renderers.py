"""Renderers that settle figures the docs once got wrong: each computes what its docstring says from raw files."""

from __future__ import annotations

from pathlib import Path

from bench.report.config_rounds import rounds_table
from bench.report.engine_counters import decode_queue
from bench.report.knees import knees_table

RESULTS = Path(__file__).parents[2] / "docs" / "results"


def test_rounds_table_prints_the_ratio_of_the_medians_beside_the_median_of_ratios() -> None:
    # cpu-first-token at 2 req/s: prefill token 56.2, 32.0, 66.1, 34.9, 71.4 ms; decode token 50.7, 48.6, 48.8, 55.9,
    # 102.7 ms. Medians 56.2 / 50.7 = 1.11 (PD's first token slower), per-round ratios' median 0.70 (faster).
    row = next(line for line in rounds_table(RESULTS, ("cpu-first-token/rounds-*.txt",)).splitlines()
               if line.startswith("| 2 |"))
    cells = [cell.strip() for cell in row.split("|")]
    assert cells[3] == "**1.11**"
    assert cells[4] == "0.70 (3 of 5 rounds lower)"


def _run_folder(tmp_path: Path, *, queued_s: float, engine_requests: int, handoffs: int) -> Path:
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "decode-metrics.txt").write_text(
        f'vllm:request_queue_time_seconds_count{{engine="0",model_name="m"}} {engine_requests}.0\n'
        f'vllm:request_queue_time_seconds_sum{{engine="0",model_name="m"}} {queued_s}\n')
    (folder / "gateway-metrics.txt").write_text(
        f"pdserve_kv_handoff_seconds_count {handoffs}.0\npdserve_kv_handoff_seconds_sum 1.0\n")
    return folder


def test_decode_queue_divides_by_the_handed_off_requests_whatever_the_engine_counted(tmp_path: Path) -> None:
    _run_folder(tmp_path, queued_s=30.0, engine_requests=182, handoffs=150)
    assert decode_queue(tmp_path, ("run",)) == (
        "30.0 s over its 182 requests, 200 ms each of the 150 handed off (the other 32: the gateway's start-up warm-ups)")


def test_knees_table_counts_a_stream_count_held_only_when_every_run_of_it_held() -> None:
    # one-core-call11-two-gateways.txt ran 512 twice: ITL p99 +2.19 ms (met) and +5.05 ms (missed, goal 5 ms),
    # so two gateways have no knee there, as `pdserve bench overhead` printed ("knee_streams": null).
    row = next(line for line in knees_table(RESULTS, ("gateway-overhead-16-cores/one-core-call11-one-gateway.txt",))
               .splitlines() if line.startswith("| 11 |"))
    cells = [cell.strip() for cell in row.split("|")]
    assert cells[4] == "below the sweep"
    assert cells[5].startswith("512 (TTFT +1.06 and +1.27 ms, ITL +2.19 and +5.05 ms")

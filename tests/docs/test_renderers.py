"""Renderers that settle figures the docs once got wrong: each computes what its docstring says from raw files."""

from __future__ import annotations

from pathlib import Path

from bench.report.config_rounds import rounds_table
from bench.report.engine_counters import decode_queue, kv_rate
from bench.report.gateway_ab import ab_windows_table
from bench.report.knees import knees_table
from bench.report.overhead import cores_busy, proxy_criterion
from bench.report.pair_runs import kv_under_load, load_windows, split_table
from bench.report.ttft import split_ms

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


def test_cores_busy_sums_each_points_three_parts_rather_than_the_ends_of_their_spans() -> None:
    # sweep-2048-streams-8-workers.txt, through the gateway: 4.992+2.832+3.859, 5.228+3.031+3.955, 5.229+3.029+3.981
    # cores. The doc once said 11.7-12.3, adding up the table's per-part spans rather than each run's parts.
    assert cores_busy(RESULTS, ("gateway-overhead-16-cores/sweep-2048-streams-8-workers.txt", "@2048")) == "11.68-12.24"


def test_proxy_criterion_counts_points_against_the_unrounded_goals() -> None:
    # 16 runs at 128 and 256 streams: every TTFT gap <= 1.5 ms; CPU ratios above 1.4x in two points at 128 (1.45, 1.42)
    assert proxy_criterion(RESULTS, ("gateway-overhead-cpu/reference-128-256-streams-2-workers-no-watcher-run*.txt",)) == (
        "the TTFT half holds in 32 of 32 points, the CPU half in 30 of 32")


def test_kv_rate_names_the_transfers_that_were_not_the_runs_handoffs(tmp_path: Path) -> None:
    folder = _run_folder(tmp_path, queued_s=1.0, engine_requests=212, handoffs=180)
    (folder / "kv-rate.json").write_text('{"transfers": 212, "gb": 85.54, "transfer_s": 2.033, "gb_per_s": 42.1}')
    assert kv_rate(tmp_path, ("run",)).startswith(
        "42.1 GB/s over 212 transfers (180 the gateway's handoffs of the runs, 32 its start-up warm-ups;")


def test_split_ms_takes_each_runs_difference_before_the_span() -> None:
    # qwen3-8b prefill time, PD's prefill engine against direct's decode engine: 29.8-26.7, 28.0-24.1, 27.6-25.1 ms
    folders = tuple(f"h100-chat-ttft/qwen3-8b/ttft-{run}" for run in (1, 2, 3))
    assert split_ms(RESULTS, (*folders, "@prefill_step_slower")) == "2.5-3.9 ms"
    assert split_ms(RESULTS, (*folders, "@gap")) == "4.0-4.7 ms"


def test_kv_under_load_leaves_out_the_transfers_before_the_load_and_reads_vllms_mb_as_mib() -> None:
    # h200x2-load-xlayer: metrics-before.txt counted 40 transfers (32 warm-ups, 2 one-block requests, 6 verify probes:
    # 34 x 18,874,368 + 6 x 452,984,832 bytes), the log's first window; the load's 400 moved 181.2 GB in 2.985 s.
    folder = RESULTS / "h200x2-load-xlayer"
    windows = load_windows(folder)
    assert [window.transfers for window in windows] == [62, 70, 68, 109, 91]
    assert round(windows[0].gb_per_s, 1) == 71.0  # 67,697.394 MiB/s, not 67.7 GB/s
    text = kv_under_load(RESULTS, ("h200x2-load-xlayer",))
    assert text.startswith("**60.7 GB/s** over 400 handoffs (181.2 GB in 2.985 s of NIXL time, 0 failed; "
                           "per 10 s window 54-71 GB/s)")
    assert "the whole log: 60.0 GB/s over 440" in text


def test_split_table_derives_the_time_outside_the_engine_core_from_unrounded_means() -> None:
    # decode engine TTFT 54.3, queue 24.4, scheduled -> first token 14.6 ms (rounded); unrounded the rest is 15.2 ms
    row = next(line for line in split_table(RESULTS, ("h200-same-gpu-ttft-split",)).splitlines()
               if "outside the engine core" in line)
    assert [cell.strip() for cell in row.split("|")][2:4] == ["(15.9, paid once)", "15.2"]


def _ab_run(folder: Path, number: int, windows: list[tuple[str, float, float]]) -> None:
    lines = ["machine at the start: AMD EPYC, 2 cores, load average 1.00, 1.00, 1.00, 2026-12-08 01:00:00 UTC"]
    lines += [f"{side} 128 streams, 2 worker(s): {cpu} us per chunk, 1 us per request (1 sent), 0.4 cores, 1 chunks/s; "
              f"TTFT p50 {ttft} ms, ITL p99 1.0 ms, 0 errors" for side, cpu, ttft in windows]
    lines.append("machine at the end: AMD EPYC, 2 cores, load average 2.00, 1.00, 1.00, 2026-12-08 01:02:00 UTC")
    (folder / f"run-{number}.txt").write_text("\n".join(lines) + "\n")


def test_ab_windows_table_pools_every_window_rather_than_taking_a_median_of_run_ratios(tmp_path: Path) -> None:
    folder = tmp_path / "cost"
    folder.mkdir()
    _ab_run(folder, 1, [("A", 10.0, 20.0), ("B", 20.0, 20.0), ("B", 20.0, 20.0), ("A", 10.0, 20.0)])  # B/A 2
    _ab_run(folder, 2, [("A", 30.0, 20.0), ("B", 15.0, 20.0), ("B", 15.0, 20.0), ("A", 30.0, 20.0)])  # B/A 0.5
    _ab_run(folder, 10, [("A", 20.0, 10.0), ("B", 21.0, 11.0), ("B", 21.0, 11.0), ("A", 20.0, 10.0)])  # 1.05
    rows = [line.split("|") for line in ab_windows_table(tmp_path, ("cost",)).splitlines()[2:]]
    assert [row[1].split("]")[0] for row in rows[:3]] == [" [run-1", " [run-2", " [run-10"]  # natural order
    assert rows[0][3].strip() == "1.00 → 2.00" and rows[0][5].strip() == "**2.000**"
    # pooled: A's windows 10, 10, 30, 30, 20, 20 -> 20; B's 20, 20, 15, 15, 21, 21 -> 20; TTFT A 20, B 20 -> 1.000
    assert rows[3][4].strip() == "20.0 / 20.0" and rows[3][5].strip() == "**1.000**"

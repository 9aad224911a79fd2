"""Renderers of bench/gpu/pd_pair.sh runs (transport.md sections 8 and 10): verify's probes, the TTFT split, and
the decode engine's NIXL counters and logged windows over the load alone."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from bench.gpu.ttft_split import read_snapshots
from bench.report.raw import bench_rows, read_json, read_text
from bench.report.tables import Renderer, fixed, percentiles, raw_link, span, table
from bench.report.ttft import means_ms

_WINDOW = re.compile(r"Num successful transfers=(\d+), Avg xfer time \(ms\)=([\d.]+), .*?Avg post time \(ms\)=([\d.]+), "
                     r".*?Avg MB per transfer=([\d.]+), Throughput \(MB/s\)=([\d.]+), Avg number of descriptors=([\d.]+)")


@dataclass(frozen=True, slots=True)
class NixlWindow:
    """One "KV Transfer metrics" line of the decode engine's log (vLLM's nixl/stats.py; its MB are MiB)."""

    transfers: int
    xfer_ms: float
    post_ms: float
    gb_per_s: float  # decimal GB/s
    descriptors: float


@dataclass(frozen=True, slots=True)
class VerifyRun:
    """One `pdserve verify` of the pair: verify.txt's table row or verify.json's entry."""

    kv_bytes: float
    engine_gbps: float
    decode_ms: float  # the decode leg: the pull and one step

    @property
    def nixl_ms(self) -> float:
        return self.kv_bytes / self.engine_gbps / 1e6


def verify_runs(folder: Path) -> list[VerifyRun]:
    """The pair's two verify runs, the table's (verify.txt) then the JSON's (verify.json)."""
    header, *rows = [line.split() for line in read_text(folder / "verify.txt").splitlines() if line.startswith(("PREFILL", "http"))]
    cells = dict(zip(header[::-1], rows[0][::-1], strict=False))  # TRANSPORTS holds spaces: read from the right
    kv_mb, handoff_gbps = float(cells["KV_MB"]), float(cells["HANDOFF_GB/s"])
    runs = [VerifyRun(kv_mb * 1e6, float(cells["ENGINE_GB/s"]), kv_mb / handoff_gbps)]
    entry = read_json(folder / "verify.json")[0]
    return [*runs, VerifyRun(entry["kv_bytes"], entry["verdict"]["measured_gbps"], entry["decode_ms"])]


def _decode_counters(path: Path) -> dict[str, float]:
    """The decode engine's series in a metrics-*.txt (pd_pair.sh samples the gateway, prefill, then decode)."""
    _, _, decode = (values for _, _, values in read_snapshots(path))
    return decode


def moved(folder: Path) -> dict[str, float]:
    """How much each of the decode engine's series grew over the load (metrics-before.txt to metrics-after.txt)."""
    before, after = (_decode_counters(folder / name) for name in ("metrics-before.txt", "metrics-after.txt"))
    return {key: value - before.get(key, 0.0) for key, value in after.items()}


def load_windows(folder: Path) -> list[NixlWindow]:
    """The decode engine's logged windows of the load alone: those after the transfers metrics-before.txt counted
    (the gateway's start-up warm-ups and `pdserve verify`'s probes, before pd_pair.sh starts the load)."""
    earlier = _decode_counters(folder / "metrics-before.txt")["vllm:nixl_xfer_time_seconds_count"]
    windows, seen = [], 0
    for count, xfer_ms, post_ms, _, mib_per_s, descriptors in _WINDOW.findall(
            read_text(folder / "decode-kv-transfer-metrics.txt")):
        if seen >= earlier:
            windows.append(NixlWindow(int(count), float(xfer_ms), float(post_ms), float(mib_per_s) * 2**20 / 1e9,
                                      float(descriptors)))
        seen += int(count)
    assert seen - sum(w.transfers for w in windows) == earlier, f"{folder}: no window ends where the load starts"
    return windows


def kv_under_load(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the decode engine's KV rate over the load alone, per window, and over its whole log for comparison."""
    folder = results_dir / folders[0]
    load, total = moved(folder), _decode_counters(folder / "metrics-after.txt")
    count, size_b = load["vllm:nixl_xfer_time_seconds_count"], load["vllm:nixl_bytes_transferred_sum"]
    seconds = load["vllm:nixl_xfer_time_seconds_sum"]
    earlier = total["vllm:nixl_xfer_time_seconds_count"] - count
    rates = [window.gb_per_s for window in load_windows(folder)]
    return (f"**{fixed(size_b / seconds / 1e9)} GB/s** over {count:.0f} handoffs ({fixed(size_b / 1e9)} GB in "
            f"{fixed(seconds, 3)} s of NIXL time, {load['vllm:nixl_num_failed_transfers_total']:.0f} failed; per 10 s "
            f"window {span(rates, 0, ' GB/s')}), counted from the load's start (`metrics-before.txt`) to its end "
            f"(`metrics-after.txt`): the {earlier:.0f} transfers before it, the gateway's start-up warm-ups and "
            f"`pdserve verify`'s probes, are left out (with them, the whole log: "
            f"{fixed(total['vllm:nixl_bytes_transferred_sum'] / total['vllm:nixl_xfer_time_seconds_sum'] / 1e9)} GB/s "
            f"over {total['vllm:nixl_xfer_time_seconds_count']:.0f}; {raw_link(folders[0] + '/decode-kv-transfer-metrics.txt')})")


def nixl_per_handoff(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: descriptors, post time and NIXL time per handoff over the load: its mean and the windows' span."""
    folder = results_dir / folders[0]
    load, windows = moved(folder), load_windows(folder)
    count = load["vllm:nixl_xfer_time_seconds_count"]
    return (f"descriptors per handoff {fixed(load['vllm:nixl_num_descriptors_sum'] / count)} on average "
            f"({span([w.descriptors for w in windows])} per window) and post time "
            f"{fixed(load['vllm:nixl_post_time_seconds_sum'] / count * 1e3, 2)} ms "
            f"({span([w.post_ms for w in windows], 2)} ms per window); NIXL time per handoff "
            f"{fixed(load['vllm:nixl_xfer_time_seconds_sum'] / count * 1e3)} ms on average, "
            f"{span([w.xfer_ms for w in windows])} ms per window")


def verify_rate(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Inline: the KV moved by the idle pair's `pdserve verify` runs (verify.txt, verify.json) and the engine's rate."""
    runs = verify_runs(results_dir / folders[0])
    return (f"{span([run.kv_bytes / 1e6 for run in runs], 0, ' MB')} at "
            f"{span([run.engine_gbps for run in runs], 0, ' GB/s')} (`pdserve verify`, {len(runs)} runs: "
            f"{raw_link(folders[0] + '/verify.txt')}, `verify.json`)")


def _descriptors(folder: Path) -> float:
    load = moved(folder)
    return load["vllm:nixl_num_descriptors_sum"] / load["vllm:nixl_num_descriptors_count"]


def variants_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """One row per run of direct and PD at one rate: PD's TTFT, its ratio to direct, the decode engine's KV figures."""
    rows = []
    for folder in folders:
        by_target = {row["target"]: row for row in bench_rows(results_dir / folder / "bench")}
        direct, pd, means = by_target["direct"], by_target["pd"], means_ms(results_dir / folder)
        rows.append([raw_link(folder), percentiles(pd, "ttft_ms"),
                     " / ".join(f"{pd['ttft_ms'][q] / direct['ttft_ms'][q]:.2f}" for q in ("p50", "p99")),
                     (f"{fixed(means['decode_queue'])}, {fixed(means['nixl'])}, {fixed(means['post'])} ms, "
                      f"{_descriptors(results_dir / folder):.0f}"), fixed(pd["itl_ms"]["p50"])])
    header = ["run", "PD TTFT p50 / p90 / p99", "ratio to direct p50 / p99",
              "decode engine: KV wait, NIXL time, post time, descriptors per handoff", "ITL p50"]
    return table(header, rows)


def split_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Where PD TTFT goes, direct against PD, for one run: means over its requests (ms) from the counters around it."""
    folder = folders[0]
    by_target = {row["target"]: row for row in bench_rows(results_dir / folder / "bench")}
    direct, pd, m = by_target["direct"], by_target["pd"], means_ms(results_dir / folder)
    ratios = " / ".join(f"{pd['ttft_ms'][q] / direct['ttft_ms'][q]:.2f}x" for q in ("p50", "p90", "p99"))
    rows = [
        ["client TTFT p50 / p90 / p99 (`bench/results.json`)", percentiles(direct, "ttft_ms"),
         f"{percentiles(pd, 'ttft_ms')} ({ratios})"],
        ["engine that prefills: arrival -> first token (vLLM `time_to_first_token`)", fixed(m["direct"]), fixed(m["prefill"])],
        ["... of which the prefill step(s) (vLLM `request_prefill_time`)", fixed(m["direct_step"]), fixed(m["prefill_step"])],
        ["gateway, prefill leg beyond the prefill engine's own TTFT (HTTP, one JSON reply)", "-", fixed(m["leg"] - m["prefill"])],
        ["gateway, handoff beyond the decode engine's own TTFT (HTTP, second request of the whole prompt)", "-",
         fixed(m["handoff"] - m["decode"])],
        ["decode engine: arrival -> first token", "-", fixed(m["decode"])],
        ["... waiting to be scheduled, KV pull included (`request_queue_time`)", "-", fixed(m["decode_queue"])],
        [f"... ... of which NIXL, post -> completion seen (`nixl_xfer_time`; post alone {fixed(m['post'])})", "-",
         fixed(m["nixl"])],
        ["... scheduled -> first token (the step computing the last prompt token, and async scheduling's one step behind)",
         "-", fixed(m["decode_step"])],
        ["... outside the engine core: tokenizing the prompt again, IPC, detokenizing",
         f"({fixed(m['direct'] - m['direct_queue'] - m['direct_step'])}, paid once)",
         fixed(m["decode"] - m["decode_queue"] - m["decode_step"])],
        ["PD TTFT at the gateway - direct", "", f"**{fixed(m['ttft'] - m['direct'])}**"],
    ]
    header = [f"TTFT, ms, mean over {pd['requests']} requests ({raw_link(folder + '/ttft-split.txt')})", "direct", "PD"]
    return table(header, rows)


def _shape_column(results_dir: Path, one_gpu: str, two_gpus: str) -> list[str]:
    """One shape's cells of shapes_table: its one-GPU run (verify and 2 req/s) and its two-GPU verify."""
    one, two = verify_runs(results_dir / one_gpu), verify_runs(results_dir / two_gpus)
    command = read_json(results_dir / one_gpu / "bench" / "results.json")["meta"]["command"]
    tokens = int(command[command.index("--input-tokens") + 1])
    kv_bytes = one[0].kv_bytes
    nixl = [run.nixl_ms for run in one]
    means = means_ms(results_dir / one_gpu)
    return [f"{tokens}", f"{fixed(kv_bytes / 1e6)} MB ({fixed(kv_bytes / tokens / 1e3)} KB)",
            f"{span(nixl, 2)} ms ({span([ms / tokens * 1e3 for ms in nixl], 2)} us)",
            f"{span([run.decode_ms for run in one], 0)} / {span([run.decode_ms for run in two], 0)} ms",
            f"{fixed(means['nixl'])} ms, {fixed(means['post'])} ms, {_descriptors(results_dir / one_gpu):.0f}",
            f"{fixed(means['handoff'])} ms", f"{raw_link(one_gpu)}, {raw_link(two_gpus)}"]


def shapes_table(results_dir: Path, folders: tuple[str, ...]) -> str:
    """Two model shapes side by side; ``folders``: each shape's pd_pair.sh run on one GPU, then its verify on two."""
    columns = [_shape_column(results_dir, one_gpu, two_gpus) for one_gpu, two_gpus in zip(folders[::2], folders[1::2], strict=True)]
    labels = ["prompt tokens (`bench run --input-tokens`)", "bytes handed off (per prompt token)",
              "idle, one GPU: NIXL time, `pdserve verify` (per prompt token)",
              "idle: decode leg, pull + one step, one GPU / two GPUs",
              "2 req/s on one GPU: NIXL time mean, post time, descriptors",
              "2 req/s on one GPU: handoff as requests saw it (gateway), mean", "raw"]
    return table(["per prompt", *(Path(one_gpu).name for one_gpu in folders[::2])],
                 [[label, *(column[i] for column in columns)] for i, label in enumerate(labels)])


RENDERERS: dict[str, Renderer] = {
    "pair_shapes_table": shapes_table,
    "pair_split_table": split_table,
    "pair_kv_under_load": kv_under_load,
    "pair_nixl_per_handoff": nixl_per_handoff,
    "pair_verify_rate": verify_rate,
    "pair_variants_table": variants_table,
}

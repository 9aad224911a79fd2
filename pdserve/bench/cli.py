"""``pdserve bench``: load generation and side-by-side comparisons. Parses flags, calls one function."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from collections.abc import Callable, Coroutine, Sequence
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
import uvloop

from pdserve.bench.compare import Way
from pdserve.bench.points import Point
from pdserve.bench.prompts import PromptMaker, prompt_maker
from pdserve.bench.report import to_markdown, write_report
from pdserve.bench.runner import Target
from pdserve.bench.stats import Slo, Summary
from pdserve.bench.sweep import Load, PoissonLoad, StreamsLoad, Workload
from pdserve.bench.workload import BenchRequest, Lengths, replay_trace, shared_prefix_chat, synthetic
from pdserve.config import Settings, load_settings
from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve.engine_key import load_engine_key
from pdserve.errors import ConfigError, PdserveError
from pdserve.logs import logging_off_the_loop

bench_app = typer.Typer(help="Measure latency and goodput, side by side.", no_args_is_help=True)
T = TypeVar("T")

RateOption = Annotated[str | None, typer.Option(help="Poisson arrival rates in requests/s, e.g. 1,2,4.")]
DurationOption = Annotated[float, typer.Option(help="Seconds of load per target and level.")]
InputOption = Annotated[str, typer.Option(help="Prompt tokens: N, or LOW-HIGH drawn uniformly.")]
OutputOption = Annotated[str, typer.Option(help="Output tokens (exact: ignore_eos): N, or LOW-HIGH.")]
TtftSloOption = Annotated[float, typer.Option(help="TTFT SLO for goodput, ms.")]
ItlSloOption = Annotated[float, typer.Option(help="SLO on each request's p90 inter-token gap, ms.")]
OutOption = Annotated[Path | None, typer.Option(help="Folder for results.{json,md,png}; default runs/bench-*.")]


class WorkloadKind(StrEnum):
    SYNTHETIC = "synthetic"
    CHAT = "chat"
    TRACE = "trace"


@bench_app.command()
def run(
    target: Annotated[list[str], typer.Option(
        "--target", "-t", help="NAME=URL[,URL...] (repeatable); several URLs share requests round-robin.")
    ] = [],  # noqa: B006
    engine_target: Annotated[list[str], typer.Option(help=(
        "NAME=URL[,URL...] of pdserve's own engines (repeatable): sent the engine key they require "
        "(PDSERVE_ENGINE_KEY, gateway.engine_key_file, else the running `pdserve up`'s), which --target never is."))
    ] = [],  # noqa: B006
    rate: RateOption = None,
    concurrency: Annotated[str | None, typer.Option(help="Fixed concurrent streams instead, e.g. 8,16.")] = None,
    duration: DurationOption = 30.0,
    workload: Annotated[WorkloadKind, typer.Option(help="synthetic, shared-prefix chat, or a JSONL trace.")] = (
        WorkloadKind.SYNTHETIC),
    input_tokens: InputOption = "256",
    output_tokens: OutputOption = "64",
    prefix_tokens: Annotated[int, typer.Option(help="chat: shared system prompt tokens.")] = 512,
    turns: Annotated[int, typer.Option(help="chat: turns per conversation.")] = 4,
    trace: Annotated[Path | None, typer.Option(help="trace: JSONL file (see `replay_trace`).")] = None,
    tokenizer: Annotated[Path | None, typer.Option(help="tokenizer.json for exact prompt lengths; "
                                                        "default: the demo model's, if built.")] = None,
    model: Annotated[str, typer.Option(help="The `model` field sent.")] = DEMO_MODEL_NAME,
    ttft_slo_ms: TtftSloOption = 500.0,
    itl_slo_ms: ItlSloOption = 100.0,
    timeout_s: Annotated[float, typer.Option(help="Per request.")] = 300.0,
    seed: int = 0,
    out: OutOption = None,
) -> None:
    """Load any OpenAI-compatible URLs side by side; report percentiles and goodput per target and level."""
    from pdserve.bench.progress import request_bar
    from pdserve.bench.sweep import sweep

    settings = _checked(load_settings)
    targets = _checked(lambda: _targets(target, engine_target, settings=settings))
    prompts = prompt_maker(tokenizer or settings.demo_model_dir / "tokenizer.json")
    make = _checked(lambda: _workload(
        workload, model=model, input_tokens=input_tokens, output_tokens=output_tokens, prefix_tokens=prefix_tokens,
        turns=turns, trace=trace, prompts=prompts, seed=seed))
    loads = _replay_load(make(0, 0)) or _checked(lambda: _loads(rate, concurrency, duration_s=duration, seed=seed))
    slo = Slo(ttft_s=ttft_slo_ms / 1000, itl_s=itl_slo_ms / 1000)
    points = _run(sweep(targets, loads, workload=make, slo=slo, timeout_s=timeout_s, progress=request_bar))
    _write(points, out=out, load_name="streams" if concurrency else "rate", slo=slo, title="pdserve bench run",
           meta={"command": sys.argv, "targets": {t.name: list(t.urls) for t in targets}, "workload": workload})


@bench_app.command()
def compare(
    config: Annotated[Path | None, typer.Option("--config", "-c", help="YAML configuration (default: CPU demo).")] = None,
    ways: Annotated[str, typer.Option(help=(
        "Which of direct,aggregated,disaggregated,auto to run (auto: the gateway decides per request, "
        "on the gateway port + 1)."))] = "direct,aggregated,disaggregated,auto",
    rate: RateOption = "1,2,4",
    duration: DurationOption = 15.0,
    input_tokens: InputOption = "128",
    output_tokens: OutputOption = "48",
    ttft_slo_ms: TtftSloOption = 500.0,
    itl_slo_ms: ItlSloOption = 100.0,
    base_port: Annotated[int, typer.Option(help="Gateway port; engines at +10.., side channels at 5610..")] = 8300,
    out: OutOption = None,
) -> None:
    """Start the engines, then run one workload direct, aggregated, disaggregated and auto, side by side."""
    from pdserve.bench.compare import run_compare
    from pdserve.bench.progress import request_bar

    settings = _checked(lambda: load_settings(config, overrides={
        "gateway.port": base_port, "prefill.base_port": base_port + 10, "decode.base_port": base_port + 20,
        "kv.side_channel_base_port": 5610, "launch.log_dir": ".pdserve/bench-logs",
    }))
    chosen = _checked(lambda: _ways(ways))
    loads = _checked(lambda: _loads(rate, None, duration_s=duration, seed=0))
    slo = Slo(ttft_s=ttft_slo_ms / 1000, itl_s=itl_slo_ms / 1000)
    result = _run(run_compare(
        settings, loads, ways=chosen,
        input_tokens=_checked(lambda: Lengths.parse(input_tokens, name="--input-tokens")),
        output_tokens=_checked(lambda: Lengths.parse(output_tokens, name="--output-tokens")), slo=slo,
        timeout_s=300.0, progress=_say, bar=request_bar,
    ))
    kv = result.kv
    _say(f"KV handoff over the sweep (decode engines' own counters): {kv.transfers:.0f} transfers, "
         f"{kv.bytes / 1e6:.1f} MB in {kv.seconds:.3f} s = {kv.gbps:.3g} GB/s, {kv.failed:.0f} failed")
    if result.legs is not None:
        _say(result.legs.describe(kv))
    _write(result.points, out=out, load_name="rate", slo=slo,
           title=f"pdserve bench compare ({config.name if config else 'CPU demo'})",
           meta={"command": sys.argv, "settings": settings.model_dump(mode="json"),
                 "kv_handoff": dataclasses.asdict(kv) | {"gbps": kv.gbps},
                 "gateway_legs": None if result.legs is None else dataclasses.asdict(result.legs)})


@bench_app.command()
def overhead(
    streams: Annotated[str, typer.Option(help="Concurrent streams; a sweep: 16,64,128,256.")] = "128",
    duration: Annotated[float, typer.Option(help="Steady-state seconds per path (direct, gateway) and point.")] = 20.0,
    output_tokens: Annotated[int, typer.Option(help="Tokens per stream.")] = 256,
    tokens_per_s: Annotated[float, typer.Option(help="Token rate of each stream.")] = 100.0,
    ttft_ms: Annotated[float, typer.Option(help="The synthetic engine's prefill time.")] = 20.0,
    rounds: Annotated[int, typer.Option(help="Alternating windows per path (ABBA order).")] = 2,
    repeats: Annotated[int, typer.Option(help="Runs of each stream count.")] = 1,
    gateway_workers: Annotated[int | None, typer.Option(help="Gateway processes (default: gateway.workers's).")] = None,
    load_processes: Annotated[int | None, typer.Option(help=(
        "Load generator processes, each with a share of the streams (default: one per 256 streams of the "
        "largest count, on at most half the cores)."), min=1)] = None,
    upstreams: Annotated[int | None, typer.Option(help=(
        "Synthetic engine processes, each on its own port (default: one per 512 streams of the largest "
        "count, on at most a quarter of the cores)."), min=1)] = None,
    gateways: Annotated[int, typer.Option(help=(
        "Separate gateways, each on its own port; the streams go round-robin over them, as through a load "
        "balancer."), min=1)] = 1,
    cores_per_gateway: Annotated[int | None, typer.Option(help=(
        "Each gateway on this many cores of its own, as if on a host of its own (its workers default to one "
        "per core); the load generator and synthetic engines on the rest (default: all share every core)."),
        min=1)] = None,
    log_dir: Annotated[Path, typer.Option(help="Logs of the upstream and gateway processes.")] = Path(
        ".pdserve/bench-overhead"),
) -> None:
    """The gateway's own cost: synthetic engines direct vs through the gateway, in alternating windows,
    with each part's CPU (the gateway's per relayed chunk) and, over a sweep, the knee. The load
    generator and the synthetic engines run in as many processes as the streams need.

    The last line printed is one JSON object: per point ttft_p50_added_ms, itl_p99_added_ms,
    throughput_ratio, gateway_cpu_us_per_chunk (relay_thread_cpu_us_per_chunk: the part its relay threads
    used), cores busy; and knee_streams.
    """
    from pdserve.bench.hosts import Hosts
    from pdserve.bench.load_processes import default_load_processes
    from pdserve.bench.overhead import (
        OverheadPlan,
        default_upstreams,
        knee_streams,
        measure_sweep,
        missed_with_room,
        saturated,
    )

    levels = _checked(lambda: _stream_levels(streams))
    hosts = None if cores_per_gateway is None else _checked(lambda: Hosts.split(
        sorted(os.sched_getaffinity(0)), gateways=gateways, cores_per_gateway=cores_per_gateway))
    cores = len(hosts.rest) if hosts else len(os.sched_getaffinity(0))  # what the other parts run on
    plan = OverheadPlan(output_tokens=output_tokens, tokens_per_s=tokens_per_s, ttft_s=ttft_ms / 1000,
                        duration_s=duration, rounds=rounds, gateway_workers=gateway_workers,
                        load_processes=load_processes or default_load_processes(max(levels), cores=cores),
                        upstreams=upstreams or default_upstreams(max(levels), cores=cores), gateways=gateways,
                        hosts=hosts)
    placement = (f"all sharing {cores} cores" if hosts is None else
                 f"each gateway on {cores_per_gateway} core(s) of its own, the rest on {cores}")
    _say(f"{','.join(map(str, levels))} streams x {output_tokens} tokens at {tokens_per_s:g} tok/s, TTFT {ttft_ms:g} ms; "
         f"{duration:g} s steady per path in {rounds} rounds, {repeats} run(s) per point; "
         f"{plan.load_processes} load process(es), {plan.upstreams} synthetic engine(s), {gateways} gateway(s) of "
         f"{gateway_workers or 'default'} workers; {placement}")
    results = _run(measure_sweep(levels, plan, repeats=repeats, log_dir=log_dir, progress=_say))
    _say("")
    for result in results:
        _say(f"streams {result.streams}")
        for name, summary in (("direct", result.direct), ("gateway", result.gateway)):
            _say("  " + _overhead_line(name, summary))
        _say("  " + result.verdict())
        _say("  " + result.cpu_line())
        if busy := saturated(result):
            _say(f"  WARNING: {', '.join(busy)} kept a core busy: this point measures them, not the gateway")
        elif (busiest := missed_with_room(result)) is not None:
            _say(f"  WARNING: missed with the gateway's busiest process only {busiest:.2f} of a core busy: a stall "
                 "set this point, not its cores filling; look for one in the machine (steal time, other tenants) "
                 "and in the gateway's log before reading this as its knee")
    knee = knee_streams([(result.streams, result.meets_goal) for result in results])
    _say(f"knee: all three goals held up to {knee} streams" if knee else "knee: goals missed at the lowest level")
    print(json.dumps({"points": [result.figures() for result in results], "knee_streams": knee}), flush=True)


def _stream_levels(text: str) -> list[int]:
    """``16,64,128`` -> [16, 64, 128]; raises ConfigError."""
    try:
        levels = [int(level) for level in text.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--streams: expected comma-separated counts, not {text!r}") from exc
    if not levels or min(levels) < 1:
        raise ConfigError(f"--streams: counts must be >= 1, not {text!r}")
    return levels


@bench_app.command()
def upstream(
    port: Annotated[int, typer.Option(help="Port on 127.0.0.1 (0 = any).")] = 8900,
    ttft_ms: Annotated[float, typer.Option(help="Prefill time of whole requests and prefill legs.")] = 20.0,
    tokens_per_s: Annotated[float, typer.Option(help="Token rate of each stream.")] = 100.0,
    handoff_ms: Annotated[float, typer.Option(help="Decode leg: delay before its first token.")] = 0.0,
) -> None:
    """A synthetic OpenAI-compatible engine that streams tokens at a set pace (no model)."""
    from pdserve.bench.upstream import Pace, serve_forever

    pace = Pace(ttft_s=ttft_ms / 1000, tokens_per_s=tokens_per_s, handoff_s=handoff_ms / 1000)
    _run(serve_forever(pace, port=port, announce=_say))


def _workload(
    kind: WorkloadKind, *, model: str, input_tokens: str, output_tokens: str, prefix_tokens: int, turns: int,
    trace: Path | None, prompts: PromptMaker, seed: int,
) -> Workload:
    """The request factory for ``kind``; raises ConfigError on bad lengths or a missing trace.

    A trace whose entries all carry timestamps is replayed whole, whatever count is asked for; a
    trace's own prompts are sent as written, to every target (no salt).
    """
    inputs = Lengths.parse(input_tokens, name="--input-tokens")
    outputs = Lengths.parse(output_tokens, name="--output-tokens")
    if kind is WorkloadKind.TRACE:
        if trace is None:
            raise ConfigError("--workload trace needs --trace FILE")
        entries = replay_trace(trace, model=model, prompts=prompts, seed=seed)
        is_timed = bool(entries) and all(entry.at_s is not None for entry in entries)
        return lambda count, _salt: entries if is_timed else _cycled(entries, count)
    if kind is WorkloadKind.CHAT:
        return lambda count, salt: shared_prefix_chat(
            count, model=model, prefix_tokens=prefix_tokens, turn_tokens=inputs, output_tokens=outputs, turns=turns,
            prompts=prompts, seed=seed, salt=salt)
    return lambda count, salt: synthetic(count, model=model, input_tokens=inputs, output_tokens=outputs,
                                         prompts=prompts, seed=seed, salt=salt)


def _replay_load(traced: list[BenchRequest]) -> list[Load]:
    """A trace whose entries all carry timestamps sets its own pace (the workload then returns it
    whole, whatever count is asked for); otherwise [] and --rate/--concurrency decide.
    """
    if not traced or any(request.at_s is None for request in traced):
        return []
    span_s = max(request.at_s or 0.0 for request in traced) or 1.0
    return [PoissonLoad(rate=len(traced) / span_s, duration_s=span_s)]


def _cycled(entries: Sequence[BenchRequest], count: int) -> list[BenchRequest]:
    return [entries[index % len(entries)] for index in range(count)]


def _ways(text: str) -> list[Way]:
    """Comma-separated ways of serving, in the order given; raises ConfigError."""
    try:
        return [Way(name.strip()) for name in text.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--ways: expected some of {','.join(Way)} ({exc})") from exc


def _loads(rate: str | None, concurrency: str | None, *, duration_s: float, seed: int) -> list[Load]:
    if (rate is None) == (concurrency is None):
        raise ConfigError("give exactly one of --rate and --concurrency")
    try:
        if rate is not None:
            return [PoissonLoad(float(level), duration_s, seed) for level in rate.split(",")]
        assert concurrency is not None
        return [StreamsLoad(int(level), duration_s) for level in concurrency.split(",")]
    except ValueError as exc:
        raise ConfigError(f"--rate/--concurrency: expected comma-separated numbers ({exc})") from exc


def _write(points: list[Point], *, out: Path | None, load_name: str, slo: Slo, title: str, meta: dict[str, Any]) -> None:
    out_dir = out or Path("runs") / time.strftime("bench-%Y%m%d-%H%M%S")
    meta = meta | {"slo_ms": {"ttft": slo.ttft_s * 1000, "itl_p90": slo.itl_s * 1000}}
    paths = write_report(points, out_dir=out_dir, load_name=load_name, meta=meta, title=title)
    _say("\n" + to_markdown(points, load_name=load_name))
    for point in points:
        for message, count in point.summary.top_errors:
            _say(f"  {point.target} @ {point.load:g}: {count} x {message}")
    _say("wrote " + ", ".join(str(path) for path in paths))


def _overhead_line(name: str, summary: Summary) -> str:
    ttft, itl = summary.ttft_ms, summary.itl_ms
    assert ttft is not None and itl is not None, f"{name}: nothing measured ({summary.errors} errors)"
    return (f"{name:<8} TTFT ms p50 {ttft.p50:6.2f} p90 {ttft.p90:6.2f} p99 {ttft.p99:6.2f} | "
            f"ITL ms p50 {itl.p50:6.2f} p90 {itl.p90:6.2f} p99 {itl.p99:6.2f} | "
            f"{summary.output_tokens_per_s:8.0f} tok/s  {summary.requests} requests  {summary.errors} errors")


def _say(line: str) -> None:
    print(line, flush=True)


def _targets(texts: Sequence[str], engine_texts: Sequence[str], *, settings: Settings) -> list[Target]:
    """``--target``s, then ``--engine-target``s with the engine key. Raises ConfigError for a malformed one, a
    malformed key, or none at all."""
    if not texts and not engine_texts:
        raise ConfigError("name at least one --target or --engine-target")
    engine_headers = load_engine_key(settings.gateway, run_dir=settings.run_dir).headers() if engine_texts else {}
    return ([Target.parse(text) for text in texts]
            + [Target.parse(text, headers=engine_headers) for text in engine_texts])


def _checked(build: Callable[[], T]) -> T:
    """``build()``, with a ConfigError turned into one line on stderr and exit status 2."""
    try:
        return build()
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from exc


def _run(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` on uvloop; a PdserveError becomes one line on stderr and exit status 1."""
    try:
        with logging_off_the_loop(logging.WARNING), asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(work)
    except PdserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2 if isinstance(exc, ConfigError) else 1) from exc

"""The ``pdserve`` command: parse arguments, resolve the configuration once, call one function."""

from __future__ import annotations

import asyncio
import sys
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import typer

from pdserve.bench.cli import bench_app
from pdserve.cli_config import ConfigOption, exit_on_errors
from pdserve.cli_config import progress as _progress
from pdserve.cli_config import run_or_exit as _run
from pdserve.cli_config import settings_or_exit as _settings  # the commands here keep the short name
from pdserve.config_doc import example_yaml
from pdserve.demo.shapes import Shape
from pdserve.deploy.cloud_cli import cloud_app
from pdserve.deploy.ray_cli import ray_app
from pdserve.deploy.render_cli import render_app
from pdserve.errors import PdserveError
from pdserve.gateway_address import find_gateway
from pdserve.logs import progress_printer

app = typer.Typer(
    help="Serve an LLM with prefill/decode disaggregation behind one OpenAI-compatible endpoint.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Print, check or explain the configuration file.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(bench_app, name="bench")
app.add_typer(render_app, name="render")
app.add_typer(cloud_app, name="cloud")
app.add_typer(ray_app, name="ray")


class LogFormatChoice(StrEnum):
    """``--log-format``'s values (launch.log_format)."""

    TEXT = "text"
    JSON = "json"


PortOption = Annotated[int | None, typer.Option(help="Gateway port (overrides gateway.port).")]
HostOption = Annotated[str | None, typer.Option(help="Gateway address (overrides gateway.host).")]
GatewayUrlOption = Annotated[str | None, typer.Option(help=(
    "The gateway (default: the one `pdserve up` recorded in its run folder, else gateway.host and port)."))]
LogFormatOption = Annotated[LogFormatChoice | None, typer.Option(
    help="pdserve's log lines: text, or json = one object per line (overrides launch.log_format).")]


def main() -> None:
    app()



@app.command()
def up(config: ConfigOption = None, port: PortOption = None, host: HostOption = None,
       log_format: LogFormatOption = None) -> None:
    """Start prefill and decode engines and the gateway; with no flags, the CPU demo."""
    from pdserve.up import run_up

    settings = _settings(config, **{"gateway.port": port, "gateway.host": host,
                                    "launch.log_format": log_format and log_format.value})
    log = settings.launch.log_format
    _run(run_up(settings, progress=progress_printer(log)), log_format=log)


@app.command()
def serve(
    config: ConfigOption = None,
    prefill_url: Annotated[list[str], typer.Option(help="A running prefill engine (repeatable).")] = [],  # noqa: B006
    decode_url: Annotated[list[str], typer.Option(help="A running decode engine (repeatable).")] = [],  # noqa: B006
    port: PortOption = None,
    host: HostOption = None,
    workers: Annotated[int | None, typer.Option(help="Gateway processes (overrides gateway.workers).")] = None,
    log_format: LogFormatOption = None,
) -> None:
    """Run only the gateway, in front of engines that are already running."""
    from pdserve.engine_key import load_engine_key
    from pdserve.engines.vllm_version import check_engine_versions
    from pdserve.gateway.server import make_gateway_server

    flags: dict[str, Any] = {"gateway.port": port, "gateway.host": host, "gateway.workers": workers,
                             "launch.log_format": log_format and log_format.value}
    if prefill_url:
        flags |= {"prefill.urls": prefill_url, "prefill.engines": 0}
    if decode_url:
        flags |= {"decode.urls": decode_url, "decode.engines": 0}
    settings = _settings(config, **flags)
    log = settings.launch.log_format

    async def serve_gateway() -> None:  # made on the loop, with logging set up: it logs its connection cap
        server = make_gateway_server(settings, handle_signals=True)
        progress_printer(log)(f"gateway on {settings.gateway.scheme}://{settings.gateway.host}:"
                              f"{settings.gateway.port}/v1 ({settings.gateway.workers} "
                              f"process{'es' if settings.gateway.workers > 1 else ''})")
        await check_engine_versions(settings, engine_key=load_engine_key(settings.gateway, run_dir=settings.run_dir))
        await server.serve()

    _run(serve_gateway(), log_format=log)


@app.command()
def verify(
    config: ConfigOption = None,
    gateway_url: Annotated[str | None, typer.Option(help=(
        "Gateway to check PD == local output through (default: the one `pdserve up` recorded, else gateway.host "
        "and port)."))] = None,
    min_fraction: Annotated[float, typer.Option(help="Fail below this share of the link's bandwidth.")] = 0.10,
    expected_gbps: Annotated[float | None, typer.Option(help="The link's bandwidth, GB/s (default: by link).")] = None,
    prompt_tokens: Annotated[int | None, typer.Option(help="Probe prompt length (default: near max_model_len).")] = None,
    probes: Annotated[int, typer.Option(min=1, help="Probes per pair; the fastest is judged.")] = 3,
    slack_ms: Annotated[float | None, typer.Option(
        min=0, help="Time a transfer may take beyond its bytes at the bar (default: 5 on host memory, else 0; "
             "0 with --expected-gbps).")] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Check the KV transfer path of a running deployment; exit 1 and say what to change if slow."""
    from pdserve.verify.run import format_reports, is_healthy, reports_json
    from pdserve.verify.run import verify as run_verify

    settings = _settings(config)
    try:
        gateway = find_gateway(settings, gateway_url=gateway_url)
        reports = asyncio.run(run_verify(settings, gateway=gateway, min_fraction=min_fraction,
                                         expected_gbps=expected_gbps, prompt_tokens=prompt_tokens, probes=probes,
                                         slack_ms=slack_ms))
    except (PdserveError, aiohttp.ClientError, TimeoutError) as exc:
        print(f"error: cannot probe the deployment: {exc}", file=sys.stderr)
        raise typer.Exit(1) from exc
    print(reports_json(reports) if as_json else format_reports(reports), flush=True)
    if not is_healthy(reports):
        raise typer.Exit(1)


@app.command()
def status(
    config: ConfigOption = None,
    gateway_url: GatewayUrlOption = None,
    timeout_s: Annotated[float, typer.Option("--timeout-s", min=0.1, help="Give up after this long.")] = 10.0,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """The running gateway's engines: role, address, health, load, prefix-cache hit rate, legs routed."""
    from pdserve.access import load_access_keys
    from pdserve.engine_key import load_engine_key
    from pdserve.engines.vllm_version import status_warnings
    from pdserve.status import fetch_rows, format_json, format_rows

    settings = _settings(config)
    with exit_on_errors():
        rows = asyncio.run(fetch_rows(find_gateway(settings, gateway_url=gateway_url),
                                      headers=load_access_keys(settings.gateway).headers(), timeout_s=timeout_s))
        warnings = asyncio.run(status_warnings([(row.role, row.url) for row in rows], timeout_s=timeout_s,
                                               engine_key=load_engine_key(settings.gateway, run_dir=settings.run_dir)))
    print(format_json(rows) if as_json else format_rows(rows), flush=True)
    for line in warnings:  # engines allowed to run a vLLM outside the supported range
        print(line, file=sys.stderr, flush=True)


@app.command()
def scale(
    pools: Annotated[list[str] | None, typer.Argument(
        help="Pool sizes, e.g. prefill=1 decode=2; none: list the engines.", show_default=False)] = None,
    config: ConfigOption = None,
    gateway_url: GatewayUrlOption = None,
    wait: Annotated[bool, typer.Option(help="Follow the engines until the pools are as asked.")] = True,
    timeout_s: Annotated[float, typer.Option("--timeout-s", min=1, help="Give up waiting after this long.")] = 1800.0,
) -> None:
    """Resize the pools of a running `pdserve up`: added engines join once ready, removed ones drain first."""
    from pdserve.access import load_access_keys
    from pdserve.scale import format_members, parse_pools
    from pdserve.scale import scale as run_scale

    try:
        body = parse_pools(pools or [])
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="POOLS") from exc
    settings = _settings(config)
    with exit_on_errors():
        members = asyncio.run(run_scale(find_gateway(settings, gateway_url=gateway_url), body,
                                        headers=load_access_keys(settings.gateway).headers(), wait=wait,
                                        timeout_s=timeout_s, progress=_progress))
    print(format_members(members), flush=True)


@app.command("demo-model")
def demo_model(
    directory: Annotated[Path | None, typer.Argument(help="Where to build it (default: the cache).")] = None,
    shape: Annotated[Shape | None, typer.Option(help=(
        "Instead: this real architecture's config.json and a padded tokenizer, no weights, for GPU runs "
        "with --load-format dummy (DIR required)."))] = None,
    random_weights: Annotated[bool, typer.Option(help=(
        "With --shape: also seeded random weights, for a tiny shape served on CPU (qwen3-next-tiny)."))] = False,
    chat_features: Annotated[bool, typer.Option(help=(
        "A variant with Qwen3's <think> and <tool_call> tags as tokens and a chat template with tools and a "
        "thinking block, for engines run with --reasoning-parser and --tool-call-parser (default DIR: "
        "demo-model-chat beside the demo model; with --shape, DIR itself)."))] = False,
) -> None:
    """Build the tiny demo model (Qwen3 architecture, local tokenizer), offline; or a real model's shape."""
    if shape is not None:
        _write_shape(directory, shape, random_weights=random_weights, chat_features=chat_features)
        return
    from pdserve.demo.model import build_demo_model

    demo_dir = _settings(None).demo_model_dir
    path = build_demo_model(demo_dir if chat_features else directory or demo_dir, progress=_progress)
    if chat_features:
        from pdserve.demo.chat_features import copy_with_chat_features  # torch: only when asked

        path = copy_with_chat_features(path, directory or demo_dir.with_name(demo_dir.name + "-chat"))
    _progress(f"demo model ready at {path}")


def _write_shape(directory: Path | None, shape: Shape, *, random_weights: bool, chat_features: bool) -> None:
    """``demo-model DIR --shape``: exit 2 without DIR, 1 when DIR holds other files."""
    from pdserve.demo.shapes import kv_bytes_per_token, write_shape_model

    if directory is None:
        print("error: --shape needs a DIR to write to", file=sys.stderr)
        raise typer.Exit(2)
    try:
        write_shape_model(directory, shape)
    except FileExistsError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(1) from exc
    if random_weights:
        from pdserve.demo.random_weights import write_random_weights  # torch + transformers: only when asked

        write_random_weights(directory)
    if chat_features:
        from pdserve.demo.chat_features import add_chat_features

        add_chat_features(directory)
    weights = "seeded random weights" if random_weights else "no weights: serve with --load-format dummy"
    _progress(f"{shape} shape ready at {directory} ({weights}; "
              f"KV cache {kv_bytes_per_token(shape):,} bytes per token)")


@config_app.command("example")
def config_example() -> None:
    """Print a documented configuration file with every option at its default."""
    sys.stdout.write(example_yaml())


@config_app.command("validate")
def config_validate(path: Annotated[Path, typer.Argument(help="The YAML file to check.")]) -> None:
    """Check a configuration file; exit 2 and name every bad field if it is invalid, and every refusal
    `render k8s` (a file setting kubernetes or eks) or `cloud up` (a file setting eks) would make."""
    from pdserve.deploy.refusals import check_cluster_config

    settings = _settings(path)
    with exit_on_errors():
        check_cluster_config(settings)
    engines = ", ".join(f"{spec.name} :{spec.port}" for spec in settings.engine_specs())
    _progress(f"{path}: valid ({engines or 'no engines'}; gateway :{settings.gateway.port})")

"""The ``pdserve`` command: parse arguments, resolve the configuration once, call one function."""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import Annotated, Any

import aiohttp
import typer
import uvloop

from pdserve.bench.cli import bench_app
from pdserve.config import Settings, load_settings
from pdserve.config_doc import example_yaml
from pdserve.errors import ConfigError, PdserveError
from pdserve.logs import logging_off_the_loop

app = typer.Typer(
    help="Serve an LLM with prefill/decode disaggregation behind one OpenAI-compatible endpoint.",
    no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
)
config_app = typer.Typer(help="Print, check or explain the configuration file.", no_args_is_help=True)
app.add_typer(config_app, name="config")
app.add_typer(bench_app, name="bench")

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML configuration file (see `pdserve config example`).")
]
PortOption = Annotated[int | None, typer.Option(help="Gateway port (overrides gateway.port).")]
HostOption = Annotated[str | None, typer.Option(help="Gateway address (overrides gateway.host).")]


def main() -> None:
    app()


def _settings(config: Path | None, **flags: Any) -> Settings:
    """The resolved configuration; a bad one exits 2 naming every bad field, before any start."""
    overrides = {key: value for key, value in flags.items() if value not in (None, [], ())}
    try:
        return load_settings(config, overrides=overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from exc


def _progress(line: str) -> None:
    print(line, flush=True)


def _run(work: Coroutine[Any, Any, None]) -> None:
    """Run ``work`` on uvloop; turn our errors into one readable line and an exit code."""
    try:
        with logging_off_the_loop(logging.INFO), asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(work)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(2) from exc
    except PdserveError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise typer.Exit(1) from exc


@app.command()
def up(config: ConfigOption = None, port: PortOption = None, host: HostOption = None) -> None:
    """Start prefill and decode engines and the gateway; with no flags, the CPU demo."""
    from pdserve.up import run_up

    settings = _settings(config, **{"gateway.port": port, "gateway.host": host})
    _run(run_up(settings, progress=_progress))


@app.command()
def serve(
    config: ConfigOption = None,
    prefill_url: Annotated[list[str], typer.Option(help="A running prefill engine (repeatable).")] = [],  # noqa: B006
    decode_url: Annotated[list[str], typer.Option(help="A running decode engine (repeatable).")] = [],  # noqa: B006
    port: PortOption = None,
    host: HostOption = None,
) -> None:
    """Run only the gateway, in front of engines that are already running."""
    from pdserve.gateway.app import build_app
    from pdserve.gateway.server import make_server

    flags: dict[str, Any] = {"gateway.port": port, "gateway.host": host}
    if prefill_url:
        flags |= {"prefill.urls": prefill_url, "prefill.engines": 0}
    if decode_url:
        flags |= {"decode.urls": decode_url, "decode.engines": 0}
    settings = _settings(config, **flags)
    server = make_server(build_app(settings), host=settings.gateway.host, port=settings.gateway.port, handle_signals=True)
    _progress(f"gateway on http://{settings.gateway.host}:{settings.gateway.port}/v1")
    _run(server.serve())


@app.command()
def verify(
    config: ConfigOption = None,
    gateway_url: Annotated[str | None, typer.Option(help="Gateway to check PD == local output through.")] = None,
    min_fraction: Annotated[float, typer.Option(help="Fail below this share of the link's bandwidth.")] = 0.10,
    expected_gbps: Annotated[float | None, typer.Option(help="The link's bandwidth, GB/s (default: by link).")] = None,
    prompt_tokens: Annotated[int | None, typer.Option(help="Probe prompt length (default: near max_model_len).")] = None,
    probes: Annotated[int, typer.Option(min=1, help="Probes per pair; the fastest is judged.")] = 3,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """Check the KV transfer path of a running deployment; exit 1 and say what to change if slow."""
    from pdserve.verify.run import format_reports, is_healthy, reports_json
    from pdserve.verify.run import verify as run_verify

    settings = _settings(config)
    url = gateway_url or f"http://{settings.gateway.host}:{settings.gateway.port}"
    try:
        reports = asyncio.run(run_verify(settings, gateway_url=url, min_fraction=min_fraction,
                                         expected_gbps=expected_gbps, prompt_tokens=prompt_tokens, probes=probes))
    except (PdserveError, aiohttp.ClientError, TimeoutError) as exc:
        print(f"error: cannot probe the deployment: {exc}", file=sys.stderr)
        raise typer.Exit(1) from exc
    print(reports_json(reports) if as_json else format_reports(reports), flush=True)
    if not is_healthy(reports):
        raise typer.Exit(1)


@app.command("demo-model")
def demo_model(
    directory: Annotated[Path | None, typer.Argument(help="Where to build it (default: the cache).")] = None,
) -> None:
    """Build the tiny demo model (Qwen3 architecture, local tokenizer), offline."""
    from pdserve.demo.model import build_demo_model

    target = directory or _settings(None).demo_model_dir
    path = build_demo_model(target, progress=_progress)
    _progress(f"demo model ready at {path}")


@config_app.command("example")
def config_example() -> None:
    """Print a documented configuration file with every option at its default."""
    sys.stdout.write(example_yaml())


@config_app.command("validate")
def config_validate(path: Annotated[Path, typer.Argument(help="The YAML file to check.")]) -> None:
    """Check a configuration file; exit 2 and name every bad field if it is invalid."""
    settings = _settings(path)
    engines = ", ".join(f"{spec.name} :{spec.port}" for spec in settings.engine_specs())
    _progress(f"{path}: valid ({engines or 'no engines'}; gateway :{settings.gateway.port})")

"""What every command-line command shares: resolving the configuration (the one place a bad
config becomes exit 2) and running its async work (our errors become one line and exit 1).

``cli.py`` and every sub-app (``deploy/render_cli.py``, ...) use it; it imports no command module,
so sub-apps can use it without importing ``cli.py``, which imports them.
"""

from __future__ import annotations

import asyncio
import logging
import sys
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer
import uvloop

from pdserve.config import Settings, load_settings
from pdserve.engine_config import LogFormat
from pdserve.errors import ConfigError, PdserveError
from pdserve.logs import error_line, logging_off_the_loop

ConfigOption = Annotated[
    Path | None, typer.Option("--config", "-c", help="YAML configuration file (see `pdserve config example`).")
]


def settings_or_exit(config: Path | None, **flags: Any) -> Settings:
    """The resolved configuration; a bad one exits 2 naming every bad field, before any start.

    ``flags`` are dotted overrides (``{"gateway.port": 9000}``); None and empty values are unset flags.
    """
    overrides = {key: value for key, value in flags.items() if value not in (None, [], ())}
    try:
        return load_settings(config, overrides=overrides)
    except ConfigError as exc:
        exit_on_config_error(exc)


def exit_on_config_error(exc: ConfigError, *, log_format: LogFormat = "text") -> NoReturn:
    """Print ``exc`` as one ``error:`` line (or JSON object) on stderr and exit 2, as every command
    does for bad config."""
    print(error_line(str(exc), log_format), file=sys.stderr)
    raise typer.Exit(2) from exc


def progress(line: str) -> None:
    """One line of progress for the user, shown at once."""
    print(line, flush=True)


@contextmanager
def exit_on_errors(*, log_format: LogFormat = "text") -> Iterator[None]:
    """Our errors become one ``error:`` line (or JSON object): exit 2 for bad configuration, 1 for the rest."""
    try:
        yield
    except ConfigError as exc:
        exit_on_config_error(exc, log_format=log_format)
    except PdserveError as exc:
        print(error_line(str(exc), log_format), file=sys.stderr)
        raise typer.Exit(1) from exc


def run_or_exit(work: Coroutine[Any, Any, None], *, log_format: LogFormat = "text") -> None:
    """Run ``work`` on uvloop, logging as ``log_format``, with our errors turned into one readable
    line and an exit code."""
    with exit_on_errors(log_format=log_format), logging_off_the_loop(logging.INFO, log_format=log_format), \
            asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(work)

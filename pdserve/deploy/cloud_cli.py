"""``pdserve cloud up|status|down``: parse flags, resolve the configuration, call one function.

A bad configuration exits 2; a missing tool or a failed step exits 1 with the step's error.
"""

from __future__ import annotations

from typing import Annotated

import typer

from pdserve.cli_config import ConfigOption, exit_on_errors, progress, settings_or_exit

cloud_app = typer.Typer(help="Run a config on Amazon EKS: cluster, EFA GPU nodes, KubeRay, the app.",
                        no_args_is_help=True)

DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Print every command and manifest in order; "
                                                               "change nothing.")]


@cloud_app.command()
def up(config: ConfigOption = None, dry_run: DryRunOption = False) -> None:
    """Create the EKS cluster and its node groups, install KubeRay, deploy the app, wait until it serves.

    Every step is skipped when already done, so running it again resumes after a failure."""
    from pdserve.deploy.cloud import cloud_up

    settings = settings_or_exit(config)
    with exit_on_errors():
        cloud_up(settings, is_dry_run=dry_run, progress=progress, config=str(config or ""))


@cloud_app.command()
def status(config: ConfigOption = None) -> None:
    """Pods and their nodes, GPU and EFA per node, the Serve app, and checks through the gateway."""
    from pdserve.deploy.cloud_status import cloud_status

    settings = settings_or_exit(config)
    with exit_on_errors():
        is_healthy = cloud_status(settings, progress=progress)
    if not is_healthy:
        raise typer.Exit(1)


@cloud_app.command()
def down(config: ConfigOption = None, dry_run: DryRunOption = False) -> None:
    """Remove the app, KubeRay and the cluster, in reverse order; what is gone already is skipped."""
    from pdserve.deploy.cloud import cloud_down

    settings = settings_or_exit(config)
    with exit_on_errors():
        cloud_down(settings, is_dry_run=dry_run, progress=progress, config=str(config or ""))

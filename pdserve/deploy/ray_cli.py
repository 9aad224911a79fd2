"""``pdserve ray up|down``: the Serve application on a running Ray cluster. Ray loads only here."""

from __future__ import annotations

from typing import Annotated

import typer

from pdserve.cli_config import ConfigOption, progress, run_or_exit, settings_or_exit

ray_app = typer.Typer(help="Deploy pdserve to a running Ray cluster as a Ray Serve application.",
                      no_args_is_help=True)
AddressOption = Annotated[str | None, typer.Option(
    help="The cluster's dashboard, e.g. http://10.0.0.1:8265 (overrides ray.address).")]



@ray_app.command("up")
def up(config: ConfigOption = None, address: AddressOption = None) -> None:
    """Deploy or update the application; return once it answers through both legs."""
    from pdserve.deploy.ray_cluster import ray_up

    run_or_exit(ray_up(settings_or_exit(config, **{"ray.address": address}), progress=progress))


@ray_app.command("down")
def down(config: ConfigOption = None, address: AddressOption = None) -> None:
    """Remove the application; its engines stop with their replicas. Other applications stay."""
    from pdserve.deploy.ray_cluster import ray_down

    run_or_exit(ray_down(settings_or_exit(config, **{"ray.address": address}), progress=progress))

"""Pure: Settings -> the Ray Serve config that ``serve deploy`` accepts and a RayService embeds.

The whole pdserve configuration travels as the application's ``args``, so the cluster runs
exactly the file the user validated; ``pdserve.ray:app`` parses it again on the cluster.
"""

from __future__ import annotations

from typing import Any

import yaml

from pdserve.config import PoolSpec, Settings
from pdserve.role import Role

IMPORT_PATH = "pdserve.ray:app"
# Serve's own HTTP proxy only answers the gateway replica's status here; tokens go to gateway.port.
ROUTE_PREFIX = "/pdserve"


def settings_args(settings: Settings) -> dict[str, Any]:
    """The configuration as plain JSON-able data, without this host's cache folder."""
    args = settings.model_dump(mode="json", exclude_defaults=True)
    args.pop("cache_dir", None)  # every node builds or finds the demo model in its own cache
    return args


def serve_config(settings: Settings) -> dict[str, Any]:
    """One Serve application running pdserve: prefill, decode and gateway deployments.

    Pool sizes go in ``deployments`` rather than ``args``: Serve applies a new replica count as a
    light update, while any change of ``args`` restarts every replica of the application.
    """
    unsized = {role.value: settings.pool(role).model_copy(update={"engines": PoolSpec().engines}) for role in Role}
    args = settings_args(settings.model_copy(update=unsized))
    return {
        # Serve's proxy is not on the token path; one on the head answers the status route.
        "proxy_location": "HeadOnly",
        "applications": [{
            "name": settings.ray.app_name,
            "import_path": IMPORT_PATH,
            "route_prefix": ROUTE_PREFIX,
            "args": args,
            "deployments": [{"name": role.value, "num_replicas": settings.pool(role).engines} for role in Role],
        }],
    }


def serve_config_yaml(settings: Settings) -> str:
    return yaml.safe_dump(serve_config(settings), sort_keys=False)

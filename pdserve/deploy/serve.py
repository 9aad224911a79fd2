"""Pure: Settings -> the Ray Serve config that ``serve deploy`` accepts and a RayService embeds.

The whole pdserve configuration travels as the application's ``args``, so the cluster runs
exactly the file the user validated; ``pdserve.ray:app`` parses it again on the cluster.
"""

from __future__ import annotations

from typing import Any

import yaml

from pdserve.cluster_config import RayAutoscalingSpec
from pdserve.config import Settings
from pdserve.engine_config import PoolSpec
from pdserve.role import Role

IMPORT_PATH = "pdserve.ray:app"
AUTOSCALING_POLICY = "pdserve.ray.autoscaling:EngineLoadPolicy"
# Serve's own HTTP proxy only answers the gateway replica's status here; tokens go to gateway.port.
ROUTE_PREFIX = "/pdserve"


def settings_args(settings: Settings) -> dict[str, Any]:
    """The configuration as plain JSON-able data, without this host's cache folder."""
    args = settings.model_dump(mode="json", exclude_defaults=True)
    args.pop("cache_dir", None)  # every node builds or finds the demo model in its own cache
    return args


def serve_config(settings: Settings) -> dict[str, Any]:
    """One Serve application running pdserve: prefill, decode and gateway deployments.

    Pool sizes (a replica count, or autoscaling) go in ``deployments`` rather than ``args``: Serve
    applies those to running replicas, while any change of ``args`` restarts every replica.
    """
    unsized = {role.value: settings.pool(role).model_copy(update={"engines": PoolSpec().engines}) for role in Role}
    unscaled = settings.ray.model_copy(update={"autoscaling": RayAutoscalingSpec()})
    args = settings_args(settings.model_copy(update={**unsized, "ray": unscaled}))
    return {
        # Serve's proxy is not on the token path; one on the head answers the status route.
        "proxy_location": "HeadOnly",
        "applications": [{
            "name": settings.ray.app_name,
            "import_path": IMPORT_PATH,
            "route_prefix": ROUTE_PREFIX,
            "args": args,
            "deployments": [{"name": role.value, **pool_size_options(settings, role)} for role in Role],
        }],
    }


def pool_size_options(settings: Settings, role: Role) -> dict[str, Any]:
    """How Serve sizes one pool: by its engines' load when ``ray.autoscaling`` is on, else ``engines`` replicas."""
    if settings.ray.autoscaling.enabled:
        return {"autoscaling_config": autoscaling_config(settings.ray.autoscaling, role)}
    return {"num_replicas": settings.pool(role).engines}


def autoscaling_config(spec: RayAutoscalingSpec, role: Role) -> dict[str, Any]:
    """Serve's autoscaling_config of one pool: its bounds, Serve's delays, pdserve's policy with its targets."""
    pool = spec.pool(role)
    return {
        "min_replicas": pool.min_engines,
        "max_replicas": pool.max_engines,
        "upscale_delay_s": spec.upscale_delay_s,
        "downscale_delay_s": spec.downscale_delay_s,
        # Unused by the policy; Serve warns that nothing scales while it exceeds max_ongoing_requests (1).
        "target_ongoing_requests": 1,
        "policy": {"policy_function": AUTOSCALING_POLICY, "policy_kwargs": pool.model_dump()},
    }


def serve_config_yaml(settings: Settings) -> str:
    return yaml.safe_dump(serve_config(settings), sort_keys=False)

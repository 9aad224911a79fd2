"""Evaluate every query of pdserve's Grafana dashboard on a Prometheus that scrapes a deployment,
and say which return data: a check that the dashboard shows something, beside the unit test that
its metric names exist (tests/deploy/test_dashboard.py). Standard library only.

    python bench/dashboard_queries.py [PROMETHEUS_URL] [--window 2m]

Dashboard variables become: $__rate_interval -> the window, $model -> .* (all), the SLOs -> their
defaults. Exit 1 if Prometheus rejects a query; an empty result is reported, not an error (a
metric with no samples yet, such as preemptions, is empty until something happens).
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parents[1] / "pdserve" / "deploy" / "dashboards" / "pdserve.json"


def substitute(expr: str, variables: dict[str, str]) -> str:
    for name in sorted(variables, key=len, reverse=True):  # $ttft_slo before a shorter prefix of it
        expr = expr.replace(f"${name}", variables[name])
    return expr


def query(prometheus_url: str, expr: str) -> tuple[str, list[dict[str, Any]]]:
    """(status, result) of an instant query; status 'error: ...' when Prometheus refuses it."""
    url = f"{prometheus_url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
    try:
        with urllib.request.urlopen(url, timeout=30) as reply:
            body = json.load(reply)
    except urllib.error.HTTPError as exc:
        return f"error: {json.load(exc).get('error', exc)}", []
    return body["status"], body["data"]["result"]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("prometheus_url", nargs="?", default="http://127.0.0.1:9090")
    parser.add_argument("--window", default="2m", help="what $__rate_interval becomes")
    args = parser.parse_args()
    board = json.loads(DASHBOARD.read_text())
    variables = {"__rate_interval": args.window, "model": ".*"}
    for variable in board["templating"]["list"]:
        if variable["type"] == "custom":
            variables[variable["name"]] = variable["current"]["value"]
    rejected = 0
    for panel in board["panels"]:
        for target in panel.get("targets", []):
            status, result = query(args.prometheus_url, substitute(target["expr"], variables))
            rejected += status != "success"
            values = ", ".join(f"{float(series['value'][1]):.4g}" for series in result[:4])
            verdict = status if status != "success" else (f"{len(result)} series: {values}" if result else "empty")
            print(f"{panel['title'][:44]:<44} {target['legendFormat'][:28]:<28} {verdict}")
    return 1 if rejected else 0


if __name__ == "__main__":
    sys.exit(main())

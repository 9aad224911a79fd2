"""``pdserve cloud up`` and ``cloud down``: find the zones, build the plan, run it (or print it).

The zone lookup is the one call made before the plan exists, because the ClusterConfig in the
plan names the zones; a dry run shows the lookup's command and placeholders instead.
"""

from __future__ import annotations

import secrets
import shlex

from pdserve.config import Settings
from pdserve.deploy.eks import plan_down, plan_up, reach_lines
from pdserve.deploy.eksctl import Zones, choose_zones, unresolved_zones, zone_query
from pdserve.deploy.runner import TOOL_SOURCES, Progress, capture, print_plan, require_tools, run_plan

RAY_TOKEN_BYTES = 32


def cloud_up(settings: Settings, *, is_dry_run: bool, progress: Progress) -> None:
    """Bring the cluster and the app up, step by step, and say how to reach it; a re-run skips what
    is done. Raises DeployError (a tool missing, a step failing) or ConfigError."""
    if not is_dry_run:
        require_tools(TOOL_SOURCES)
    zones = _find_zones(settings, is_dry_run=is_dry_run, progress=progress)
    # a fresh token each time; the plan stores it only if the cluster has none yet
    steps = plan_up(settings, zones=zones, ray_token=secrets.token_urlsafe(RAY_TOKEN_BYTES))
    if is_dry_run:
        print_plan(steps, progress=progress)
        return
    run_plan(steps, progress=progress)
    for line in reach_lines(settings):
        progress(line)


def cloud_down(settings: Settings, *, is_dry_run: bool, progress: Progress) -> None:
    """Remove everything ``cloud_up`` made, in reverse; what is already gone is skipped."""
    steps = plan_down(settings)
    if is_dry_run:
        print_plan(steps, progress=progress)
        return
    run_plan(steps, progress=progress)
    progress(f"cluster {settings.eks.cluster_name} ({settings.eks.region}) and everything on it removed")


def _find_zones(settings: Settings, *, is_dry_run: bool, progress: Progress) -> Zones:
    query = zone_query(settings.eks)
    if is_dry_run:
        progress(f"zones: looked up first with: {shlex.join(query)}")
        return unresolved_zones(settings.eks)
    zones = choose_zones(capture(query, what="zone lookup"), settings.eks)
    progress(f"zones: GPU nodes in {zones.gpu}; cluster in {', '.join(zones.cluster)}")
    return zones

"""The renderers by name: each takes docs/results/ and the block's folders and returns Markdown."""

from __future__ import annotations

from collections.abc import Mapping

from bench.report import (
    bench_results,
    config_rounds,
    decode_token,
    engine_counters,
    first_start,
    gateway_ab,
    gateway_cost,
    knees,
    netbed,
    overhead,
    pair_runs,
    per_request,
    ray_compare,
    side_by_side,
    soak,
    spans,
    ttft,
    verify_runs,
)
from bench.report.tables import Renderer


def renderers() -> Mapping[str, Renderer]:
    """Every renderer of every doc section family."""
    families = (side_by_side.RENDERERS, ttft.RENDERERS, netbed.RENDERERS, verify_runs.RENDERERS,
                gateway_cost.RENDERERS, config_rounds.RENDERERS, engine_counters.RENDERERS, spans.RENDERERS,
                overhead.RENDERERS, ray_compare.RENDERERS,
                first_start.RENDERERS, bench_results.RENDERERS,
                decode_token.RENDERERS, soak.RENDERERS, knees.RENDERERS,
                gateway_ab.RENDERERS, per_request.RENDERERS, pair_runs.RENDERERS)
    merged: dict[str, Renderer] = {}
    for family in families:
        clash = merged.keys() & family.keys()
        assert not clash, f"renderer names defined twice: {sorted(clash)}"
        merged.update(family)
    return merged

from __future__ import annotations

import pytest
from ray.serve._private.common import DeploymentID, ReplicaID
from ray.serve.config import AutoscalingConfig, AutoscalingContext
from ray.serve.schema import ServeDeploySchema

from pdserve.cluster_config import PoolScalingSpec
from pdserve.config import Settings, parse_settings
from pdserve.deploy.serve import AUTOSCALING_POLICY, serve_config
from pdserve.errors import ConfigError
from pdserve.ray.app import engine_options
from pdserve.ray.autoscaling import EngineLoadPolicy
from pdserve.ray.pool_size import (
    KV_USAGE_STAT,
    REQUESTS_STAT,
    EngineStats,
    engine_stats,
    next_pool_size,
    report_stats,
)
from pdserve.role import Role
from pdserve.routing.load import parse_engine_load
from tests.routing.test_load import vllm_load_metrics

SPEC = PoolScalingSpec(min_engines=1, max_engines=6, target_requests=8, max_kv_usage=0.8)
AUTOSCALING_ON = {"ray": {"autoscaling": {"enabled": True, "decode": {"min_engines": 2, "max_engines": 8}}}}


def engines(*requests: float, kv_usage: float = 0.0) -> list[EngineStats]:
    return [EngineStats(requests=count, kv_usage=kv_usage) for count in requests]


def test_a_pool_grows_at_once_to_the_engines_its_requests_need() -> None:
    # 2 engines carrying 40 requests at 8 per engine need 5.
    assert next_pool_size(engines(20, 20), target=2, running=2, spec=SPEC) == 5


def test_a_pool_grows_for_kv_use_over_the_bound_though_its_requests_are_few() -> None:
    # 0.9 + 0.9 of a KV cache at 0.8 per engine need 3 engines.
    assert next_pool_size(engines(1, 1, kv_usage=0.9), target=2, running=2, spec=SPEC) == 3


def test_a_pool_shrinks_one_engine_at_a_time_however_idle() -> None:
    assert next_pool_size(engines(0, 0, 0, 0), target=4, running=4, spec=SPEC) == 3
    assert next_pool_size(engines(0, 0, 0), target=3, running=3, spec=SPEC) == 2


def test_a_pool_at_its_targets_keeps_its_size() -> None:
    # 24 requests fit 3 engines exactly; 17 would not fit 2.
    assert next_pool_size(engines(8, 8, 8), target=3, running=3, spec=SPEC) == 3
    assert next_pool_size(engines(6, 6, 5), target=3, running=3, spec=SPEC) == 3


def test_the_size_stays_within_the_bounds() -> None:
    assert next_pool_size(engines(100, 100), target=2, running=2, spec=SPEC) == SPEC.max_engines
    assert next_pool_size(engines(0), target=1, running=1, spec=SPEC) == SPEC.min_engines
    # Bounds changed under a running pool: back inside them at once.
    assert next_pool_size(engines(0) * 9, target=9, running=9, spec=SPEC) == SPEC.max_engines
    assert next_pool_size(engines(0), target=1, running=1, spec=SPEC.model_copy(update={"min_engines": 3})) == 3


def test_without_any_report_the_size_stays() -> None:
    assert next_pool_size([], target=3, running=3, spec=SPEC) == 3


def test_a_pool_shrinks_only_on_a_report_from_every_running_engine() -> None:
    # Two of three engines idle, the third not heard from: it may be the busy one.
    assert next_pool_size(engines(0, 0), target=3, running=3, spec=SPEC) == 3
    # ...but what those that reported carry is enough to grow on.
    assert next_pool_size(engines(30, 30), target=3, running=3, spec=SPEC) == 6


def test_a_pool_still_starting_engines_is_not_grown_twice_for_the_same_load() -> None:
    # Serve is bringing up a third engine for 20 requests; two run and report them.
    assert next_pool_size(engines(10, 10), target=3, running=2, spec=SPEC) == 3


def test_stats_count_only_running_replicas_that_reported_both_values() -> None:
    aggregated = {REQUESTS_STAT: {"a": 3.0, "b": 1.0, "gone": 9.0}, KV_USAGE_STAT: {"a": 0.5, "gone": 0.9}}
    assert engine_stats(aggregated, ["a", "b", "new"]) == [EngineStats(requests=3.0, kv_usage=0.5)]
    assert engine_stats({}, ["a"]) == []


def test_a_replica_reports_running_plus_waiting_and_kv_use_from_the_engines_metrics() -> None:
    text = vllm_load_metrics(running=3, waiting=2, kv_usage=0.25)
    assert report_stats(parse_engine_load(text, read_s=0.0)) == {REQUESTS_STAT: 5.0, KV_USAGE_STAT: 0.25}


def context(metrics: dict[str, dict[ReplicaID, float]], replicas: list[ReplicaID], *, target: int) -> AutoscalingContext:
    return AutoscalingContext(
        deployment_id=replicas[0].deployment_id, deployment_name="decode", app_name="pdserve",
        current_num_replicas=len(replicas), target_num_replicas=target, running_replicas=replicas,
        total_num_requests=0.0, total_queued_requests=0.0, aggregated_metrics=metrics, raw_metrics={},
        capacity_adjusted_min_replicas=1, capacity_adjusted_max_replicas=6, policy_state={},
        last_scale_up_time=None, last_scale_down_time=None, current_time=0.0, config=None,
    )


def test_serve_builds_the_policy_from_the_config_and_it_sizes_by_the_reported_load() -> None:
    options = engine_options(parse_settings(AUTOSCALING_ON, source="t"), Role.DECODE)
    config = AutoscalingConfig(**options["autoscaling_config"])  # Serve imports and pickles the policy here
    policy = config.policy.get_policy()(**config.policy.policy_kwargs)
    replicas = [ReplicaID(unique_id, DeploymentID("decode", "pdserve")) for unique_id in ("a", "b")]
    busy = {REQUESTS_STAT: {replicas[0]: 70.0, replicas[1]: 60.0}, KV_USAGE_STAT: {replicas[0]: 0.2, replicas[1]: 0.2}}
    assert policy(context(busy, replicas, target=2)) == (5, {})  # 130 requests at 32 per engine
    idle = {REQUESTS_STAT: dict.fromkeys(replicas, 0.0), KV_USAGE_STAT: dict.fromkeys(replicas, 0.0)}
    assert policy(context(idle, replicas, target=2)) == (2, {})  # decode's min_engines
    assert EngineLoadPolicy(**config.policy.policy_kwargs)(context({}, replicas, target=2)) == (2, {})


def test_autoscaling_is_off_by_default_and_pools_get_their_engines() -> None:
    options = engine_options(Settings(), Role.PREFILL)
    assert options["num_replicas"] == 1 and "autoscaling_config" not in options


def test_on_each_pool_gets_serves_autoscaling_with_its_bounds_and_the_policy_instead_of_a_count() -> None:
    settings = parse_settings(AUTOSCALING_ON, source="t")
    decode = engine_options(settings, Role.DECODE)
    assert "num_replicas" not in decode
    assert decode["autoscaling_config"] | {"policy": None} == {
        "min_replicas": 2, "max_replicas": 8, "upscale_delay_s": 30.0, "downscale_delay_s": 600.0,
        "target_ongoing_requests": 1, "policy": None}
    assert decode["autoscaling_config"]["policy"] == {"policy_function": AUTOSCALING_POLICY, "policy_kwargs": {
        "min_engines": 2, "max_engines": 8, "target_requests": 32.0, "max_kv_usage": 0.8}}
    # Serve's own check: nothing scales while target_ongoing_requests exceeds max_ongoing_requests.
    assert decode["autoscaling_config"]["target_ongoing_requests"] <= decode["max_ongoing_requests"]
    prefill = engine_options(settings, Role.PREFILL)["autoscaling_config"]
    assert prefill["policy"]["policy_kwargs"]["target_requests"] == 4.0


def test_the_serve_config_carries_autoscaling_in_deployments_so_tuning_it_restarts_no_engine() -> None:
    tuned = {"ray": {"autoscaling": {"enabled": True, "decode": {"target_requests": 16, "max_engines": 3}}}}
    before, after = (serve_config(parse_settings(tree, source="t")) for tree in (AUTOSCALING_ON, tuned))
    ServeDeploySchema(**after)  # what `serve deploy` and the dashboard's REST API accept
    app_before, app_after = before["applications"][0], after["applications"][0]
    assert app_before["args"] == app_after["args"] and "autoscaling" not in app_after["args"].get("ray", {})
    deployments = {deployment["name"]: deployment for deployment in app_after["deployments"]}
    assert deployments["decode"]["autoscaling_config"]["max_replicas"] == 3
    assert "num_replicas" not in deployments["prefill"]


def test_each_pool_keeps_its_own_default_target_when_only_its_bounds_are_set() -> None:
    scaling = parse_settings(AUTOSCALING_ON, source="t").ray.autoscaling
    assert (scaling.prefill.target_requests, scaling.decode.target_requests) == (4.0, 32.0)


def test_bounds_upside_down_are_a_config_error_naming_the_pool() -> None:
    with pytest.raises(ConfigError, match="ray.autoscaling.prefill"):
        parse_settings({"ray": {"autoscaling": {"prefill": {"min_engines": 3, "max_engines": 2}}}}, source="t")


def test_serve_gives_a_stopping_replica_time_to_drain_its_engine_and_stop_it() -> None:
    settings = parse_settings({"ray": {"drain_timeout_s": 120}}, source="t")
    assert engine_options(settings, Role.DECODE)["graceful_shutdown_timeout_s"] > 120 + 20  # drain, then SIGTERM grace

from __future__ import annotations

import socket
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

from pdserve.cluster_config import RaySpec
from pdserve.config import load_settings, parse_settings
from pdserve.deploy.serve import serve_config
from pdserve.ray.app import app, engine_options
from pdserve.ray.engine_replica import (
    Unanswered,
    port_if_free,
    replica_cpu_bind,
    replica_engine_spec,
    replica_ranks,
)
from pdserve.ray.gateway_replica import GatewayReplica, registration_ttl_s
from pdserve.role import Role
from tests.conftest import free_port_block


def test_engine_replicas_ask_for_the_pool_count_cpus_gpus_and_custom_resources() -> None:
    settings = parse_settings({
        "prefill": {"engines": 2, "placement": {"cpus": 4, "resources": {"prefill": 1}}},
        "decode": {"device": "cuda", "gpu_ids": [0, 1], "tensor_parallel_size": 2, "placement": {"cpus": 8}},
        "ray": {"health_check_period_s": 3},
    }, source="t")
    prefill = engine_options(settings, Role.PREFILL)
    assert prefill["name"] == "prefill" and prefill["num_replicas"] == 2 and prefill["health_check_period_s"] == 3
    assert prefill["ray_actor_options"] == {"num_cpus": 4.0, "num_gpus": 0, "resources": {"prefill": 1.0}}
    # Serve must not cut short a probe that may itself wait gateway.health_timeout_s.
    assert prefill["health_check_timeout_s"] > settings.gateway.health_timeout_s
    # ...nor give up on a replica actor that a busy node holds up sooner than Serve itself would.
    assert prefill["health_check_timeout_s"] >= 30
    slow_probe = parse_settings({"gateway": {"health_timeout_s": 40}}, source="t")
    assert engine_options(slow_probe, Role.PREFILL)["health_check_timeout_s"] > 40
    assert "placement_group_bundles" not in prefill
    decode = engine_options(settings, Role.DECODE)
    assert decode["ray_actor_options"]["num_gpus"] == 2
    # One engine over two GPUs: both on one node, in one bundle.
    assert decode["placement_group_bundles"] == [{"CPU": 8.0, "GPU": 2.0}]
    assert decode["placement_group_strategy"] == "STRICT_PACK"


def test_cpu_engines_bind_the_configured_cores_by_rank_on_their_node_else_all() -> None:
    assert replica_cpu_bind(["0", "1"], local_rank=1, cpus=[0, 1, 2]) == "1"
    assert replica_cpu_bind(["0", "1"], local_rank=2, cpus=[0, 1, 2]) == "0"
    assert replica_cpu_bind([], local_rank=0, cpus=[0, 1, 2]) == "0,1,2"


def test_a_running_engine_that_misses_probes_is_unhealthy_only_after_the_grace() -> None:
    unanswered = Unanswered(grace_s=60.0)
    assert unanswered.verdict("TimeoutError after 5 s", now_s=100.0) is None
    assert unanswered.verdict("TimeoutError after 5 s", now_s=150.0) is None
    assert unanswered.verdict(None, now_s=155.0) is None  # an answer starts the count afresh
    assert unanswered.verdict("status 503", now_s=160.0) is None
    assert unanswered.verdict("status 503", now_s=221.0) == "status 503, no healthy answer for 61 s"


def test_an_engine_survives_two_missed_health_checks_in_the_registry() -> None:
    assert registration_ttl_s(RaySpec(health_check_period_s=2.0), health_timeout_s=5.0) == 11.0


def test_gateway_replicas_one_per_node_offering_the_gateway_resources_with_one_registry() -> None:
    args = {"gateway": {"replicas": 3}, "ray": {"gateway_resources": {"head": 1}}}
    gateway = app(args)._bound_deployment  # the ingress, as Serve is given it
    registry = gateway.init_args[3]._bound_deployment
    assert gateway.num_replicas == 3 and gateway._replica_config.max_replicas_per_node == 1
    assert gateway.ray_actor_options["resources"] == {"head": 1.0}
    assert (registry.name, registry.num_replicas, registry.ray_actor_options) == ("registry", 1, {"num_cpus": 0})


def test_resizing_a_pool_changes_only_its_replica_count_in_the_serve_config() -> None:
    before, after = (serve_config(parse_settings({"decode": {"engines": engines}}, source="t"))["applications"][0]
                     for engines in (1, 2))
    # Any change of args restarts every replica of the app; a replica count is a light update.
    assert before["args"] == after["args"] and "engines" not in after["args"].get("decode", {})
    assert after["deployments"] == [{"name": "prefill", "num_replicas": 1}, {"name": "decode", "num_replicas": 2}]


def test_replica_ranks_from_either_form_ray_gives() -> None:
    from ray.serve.schema import ReplicaRank

    assert replica_ranks(ReplicaRank(rank=3, node_rank=1, local_rank=1)) == (3, 1)
    assert replica_ranks(2) == (2, 0)


def test_side_channel_port_is_the_same_for_a_rank_on_its_node_and_moves_off_a_taken_one() -> None:
    settings = parse_settings({"kv": {"side_channel_base_port": free_port_block(4)}}, source="t")
    base = settings.kv.side_channel_base_port
    specs = [replica_engine_spec(settings, role, host="127.0.0.1", rank=5, local_rank=local_rank, instance="x",
                                 gpu_ids=[])
             for role in Role for local_rank in (0, 1)]
    assert [spec.side_channel_port for spec in specs] == [base, base + 2, base + 1, base + 3]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", base))
        assert port_if_free("127.0.0.1", base) != base


def test_api_port_is_the_pools_base_port_by_node_rank_so_a_pod_names_it() -> None:
    base = free_port_block(4)
    settings = parse_settings({"prefill": {"base_port": base}, "decode": {"base_port": base + 2}}, source="t")
    specs = [replica_engine_spec(settings, role, host="127.0.0.1", rank=5, local_rank=local_rank, instance="x",
                                 gpu_ids=[])
             for role in Role for local_rank in (0, 1)]
    assert [spec.port for spec in specs] == [base, base + 1, base + 2, base + 3]


def test_the_ray_cpu_example_fits_the_laptop_recipes_two_core_head() -> None:
    """docs/deploy.md: `ray start --head --node-ip-address 127.0.0.1 --resources '{"head": 1, "prefill": 1,
    "decode": 1}'` on a 2-core machine offers 2 CPUs and those resources; the registry reserves none."""
    settings = load_settings(Path(__file__).parents[2] / "examples" / "ray-cpu.yaml")
    head = Counter({"CPU": 2.0, "head": 1.0, "prefill": 1.0, "decode": 1.0})
    asked: Counter[str] = Counter()
    for role in Role:
        options = engine_options(settings, role)
        per_replica = {"CPU": options["ray_actor_options"]["num_cpus"], **options["ray_actor_options"]["resources"]}
        asked.update({name: amount * options["num_replicas"] for name, amount in per_replica.items()})
    asked.update({"CPU": settings.ray.gateway_cpus * settings.gateway.replicas, **settings.ray.gateway_resources})
    assert all(amount <= head[name] for name, amount in asked.items()), (asked, head)


async def test_serves_own_route_names_the_api_and_no_engine_address() -> None:
    """Serve's proxy answers anyone who reaches it: the engines' addresses stay behind the gateway's admin key."""
    replica = SimpleNamespace(_scheme="http", _server=SimpleNamespace(host="127.0.0.1", port=9000))
    body = await GatewayReplica.__call__(replica, None)  # type: ignore[arg-type]
    assert body == {"openai_api": "http://127.0.0.1:9000/v1"}

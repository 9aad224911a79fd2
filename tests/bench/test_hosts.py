"""Gateways on cores of their own (bench/hosts.py), and ``bench overhead`` through more than one gateway."""

from __future__ import annotations

import contextlib
import dataclasses
import os
from pathlib import Path

import psutil
import pytest

from pdserve.bench.cpu import with_descendants
from pdserve.bench.hosts import Hosts, confined
from pdserve.bench.overhead import OverheadPlan, measure_sweep
from pdserve.errors import ConfigError

_TINY = OverheadPlan(output_tokens=20, tokens_per_s=200.0, duration_s=1.0, rounds=2)


def test_each_gateway_gets_its_own_cores_in_order_and_the_rest_the_others() -> None:
    hosts = Hosts.split([7, 0, 1, 2, 3, 4, 5, 6], gateways=2, cores_per_gateway=3)
    assert hosts.gateways == (frozenset({0, 1, 2}), frozenset({3, 4, 5}))
    assert hosts.rest == frozenset({6, 7})


def test_gateways_may_not_take_every_core() -> None:
    with pytest.raises(ConfigError, match="need more than 4 cores"):
        Hosts.split(range(4), gateways=2, cores_per_gateway=2)
    with pytest.raises(ConfigError):
        Hosts.split(range(4), gateways=1, cores_per_gateway=0)


def test_confined_gives_the_cores_back() -> None:
    before = os.sched_getaffinity(0)
    with confined(frozenset({min(before)})):
        assert os.sched_getaffinity(0) == {min(before)}
    assert os.sched_getaffinity(0) == before


def _children() -> set[int]:
    return {process.pid for process in psutil.Process().children(recursive=True)}


def _placement(earlier: set[int]) -> dict[str, set[int]]:
    """The cores each kind of process the sweep started may run on now: a gateway (``pdserve serve``)
    with its workers, and the rest. Processes in ``earlier`` (left by tests before this one) are not the
    sweep's, and one that exits while this reads it is skipped."""
    children = [process for process in psutil.Process().children(recursive=True) if process.pid not in earlier]
    in_gateway: set[int] = set()
    cores: dict[str, set[int]] = {"gateway": set(), "other": set()}
    for process in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            if "serve" in process.cmdline():
                in_gateway.update(descendant.pid for descendant in with_descendants(process))
    for process in children:
        with contextlib.suppress(psutil.NoSuchProcess):
            cores["gateway" if process.pid in in_gateway else "other"].update(process.cpu_affinity())
    return cores


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="one core for the gateway, one for the rest")
async def test_a_gateway_on_its_own_core_runs_only_there_and_the_other_parts_on_the_rest(tmp_path: Path) -> None:
    before = os.sched_getaffinity(0)
    hosts = Hosts.split(sorted(before), gateways=1, cores_per_gateway=1)
    seen: list[dict[str, set[int]]] = []
    earlier = _children()
    plan = dataclasses.replace(_TINY, hosts=hosts)
    (result,) = await measure_sweep([4], plan, repeats=1, log_dir=tmp_path,
                                    progress=lambda line: seen.append(_placement(earlier)) if "round" in line else None)
    assert result.gateway.errors == 0 and result.gateway.requests > 0
    assert seen and all(cores["gateway"] == set(hosts.gateways[0]) for cores in seen)
    assert all(cores["other"] and cores["other"] <= hosts.rest for cores in seen)
    assert os.sched_getaffinity(0) == before


async def test_the_streams_go_round_robin_over_every_gateway(tmp_path: Path) -> None:
    plan = dataclasses.replace(_TINY, gateways=2, gateway_workers=1)
    (result,) = await measure_sweep([4], plan, repeats=1, log_dir=tmp_path, progress=lambda line: None)
    assert result.gateway.errors == 0
    served = [sum("mode=pd" in line and "status=200" in line  # the gateway's line per request (gateway/relay.py)
                  for line in (tmp_path / f"gateway-{index}.log").read_text().splitlines()) for index in range(2)]
    assert min(served) >= 4, served


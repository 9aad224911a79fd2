"""The per-deployment engine key: where it comes from, its file in the run folder, what carries it."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from pdserve.engine_key import (
    KEY_FILE,
    NO_ENGINE_KEY,
    EngineKey,
    deployment_engine_key,
    load_engine_key,
)
from pdserve.errors import ConfigError
from pdserve.gateway_config import GatewaySpec
from pdserve_vllm import ENGINE_KEY_ENV

GIVEN = "given-engine-key-0123456789"


@pytest.fixture(autouse=True)
def no_key_in_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_KEY_ENV, raising=False)


def test_up_makes_a_new_key_per_deployment_in_a_file_only_its_user_reads_and_removes_it_on_stop(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with deployment_engine_key(GatewaySpec(), run_dir=run_dir) as key:
        path = run_dir / KEY_FILE
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text().strip() == key.value and len(key.value) >= 43  # token_urlsafe(32)
        assert load_engine_key(GatewaySpec(), run_dir=run_dir) == key  # what `verify` and `serve` find
        assert [entry.name for entry in run_dir.iterdir()] == [KEY_FILE]  # no copy left aside
    assert not path.exists()
    with deployment_engine_key(GatewaySpec(), run_dir=run_dir) as second:
        assert second != key
    with pytest.raises(RuntimeError), deployment_engine_key(GatewaySpec(), run_dir=run_dir):
        raise RuntimeError("an engine failed to start")
    assert not path.exists()


def test_a_given_key_is_used_as_is_and_written_nowhere(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENGINE_KEY_ENV, GIVEN)
    with deployment_engine_key(GatewaySpec(), run_dir=tmp_path) as key:
        assert key.value == GIVEN and not list(tmp_path.iterdir())


def test_running_engines_key_comes_from_the_env_else_the_key_file_else_up_s_run_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key_file, run_dir = tmp_path / "engines.key", tmp_path / "run"
    key_file.write_text("file-engine-key-0123456789\n")
    run_dir.mkdir()
    (run_dir / KEY_FILE).write_text("run-folder-key-0123456789\n")
    with_file = GatewaySpec(engine_key_file=str(key_file))
    assert load_engine_key(GatewaySpec(), run_dir=tmp_path) is NO_ENGINE_KEY
    assert load_engine_key(GatewaySpec(), run_dir=run_dir).value == "run-folder-key-0123456789"
    assert load_engine_key(with_file, run_dir=run_dir).value == "file-engine-key-0123456789"
    monkeypatch.setenv(ENGINE_KEY_ENV, GIVEN)
    assert load_engine_key(with_file, run_dir=run_dir).value == GIVEN


@pytest.mark.parametrize("bad", ["S3CR3T", "two S3CR3T-0123456789", "line\nS3CR3T-0123456789"])
def test_a_malformed_key_is_refused_without_echoing_it(tmp_path: Path, bad: str) -> None:
    key_file = tmp_path / "engines.key"
    key_file.write_text(bad)
    with pytest.raises(ConfigError, match="engine_key_file") as refused:
        load_engine_key(GatewaySpec(engine_key_file=str(key_file)), run_dir=tmp_path)
    assert "S3CR3T" not in str(refused.value)


def test_the_key_rides_in_a_header_and_the_engine_env_never_in_a_repr() -> None:
    key = EngineKey(GIVEN)
    assert key.headers() == {"Authorization": f"Bearer {GIVEN}"}
    assert key.engine_env() == {ENGINE_KEY_ENV: GIVEN, "VLLM_API_KEY": GIVEN}
    assert GIVEN not in repr(key) and GIVEN not in str(key)
    assert NO_ENGINE_KEY.headers() == {} and NO_ENGINE_KEY.engine_env() == {}

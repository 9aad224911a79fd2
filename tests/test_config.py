from __future__ import annotations

import types
from pathlib import Path

import pytest
import yaml

import pdserve
from pdserve.config import load_settings, parse_settings
from pdserve.config_doc import example_yaml
from pdserve.errors import ConfigError
from pdserve.role import Role


def test_public_api_is_exactly_all() -> None:
    public = {name for name in dir(pdserve) if not name.startswith("_")}
    exported = {name for name in public if not isinstance(getattr(pdserve, name), types.ModuleType)}
    assert sorted(pdserve.__all__) == pdserve.__all__
    assert set(pdserve.__all__) == exported


def test_example_config_loads_to_the_defaults(tmp_path: Path) -> None:
    path = tmp_path / "pdserve.yaml"
    path.write_text(example_yaml())
    assert load_settings(path) == load_settings(None)


def test_every_bad_field_is_named_by_path() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings({"gateway": {"port": "x"}, "prefill": {"engines": -1}, "kv": {"speed": 1}}, source="t")
    message = str(caught.value)
    assert "gateway.port" in message and "prefill.engines" in message and "kv.speed" in message


def test_yaml_errors_and_non_mappings_are_config_errors(tmp_path: Path) -> None:
    (tmp_path / "bad.yaml").write_text("a: [1,")
    (tmp_path / "list.yaml").write_text("- 1\n")
    for name in ("bad.yaml", "list.yaml", "missing.yaml"):
        with pytest.raises(ConfigError):
            load_settings(tmp_path / name)


def test_precedence_is_file_then_env_then_flags(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"gateway": {"port": 9001, "host": "0.0.0.0"}, "decode": {"engines": 2}}))
    monkeypatch.setenv("PDSERVE_GATEWAY__PORT", "9002")
    monkeypatch.setenv("PDSERVE_PREFILL__CPU_THREADS_BIND", "['0-1']")
    settings = load_settings(path, overrides={"gateway.host": "127.0.0.2"})
    assert settings.gateway.port == 9002 and settings.gateway.host == "127.0.0.2"
    assert settings.prefill.cpu_threads_bind == ["0-1"] and settings.decode.engines == 2


def test_engine_specs_get_unique_ports_and_ids() -> None:
    settings = parse_settings({"prefill": {"engines": 2, "base_port": 8100}, "decode": {"engines": 2, "base_port": 8200}}, source="t")
    specs = settings.engine_specs()
    assert [spec.name for spec in specs] == ["prefill-0", "prefill-1", "decode-0", "decode-1"]
    assert len({spec.side_channel_port for spec in specs}) == 4 and len({spec.engine_id for spec in specs}) == 4
    assert settings.endpoint_urls(Role.DECODE) == ["http://127.0.0.1:8200", "http://127.0.0.1:8201"]


def test_port_clash_and_missing_gpus_are_rejected() -> None:
    with pytest.raises(ConfigError, match="ports used twice"):
        parse_settings({"prefill": {"base_port": 8000}}, source="t")
    with pytest.raises(ConfigError, match="gpu_ids needs 2"):
        parse_settings({"prefill": {"base_port": 8100, "device": "cuda", "engines": 2, "gpu_ids": [0]}}, source="t")


def test_bare_yaml_on_and_off_mean_the_mps_modes(tmp_path: Path) -> None:
    for text, mode in (("off", "off"), ("on", "on"), ("auto", "auto")):
        (tmp_path / "c.yaml").write_text(f"launch: {{mps: {text}}}\n")
        assert load_settings(tmp_path / "c.yaml").launch.mps == mode


def test_engine_urls_must_be_plain_http_origins() -> None:
    settings = parse_settings({"prefill": {"engines": 0, "urls": ["http://10.0.0.5:8100/"]}}, source="test")
    assert settings.endpoint_urls(Role.PREFILL) == ["http://10.0.0.5:8100"]
    for bad in ("https://10.0.0.5:8100", "10.0.0.5:8100", "http://10.0.0.5:8100/v1"):
        with pytest.raises(ConfigError, match="prefill.urls"):
            parse_settings({"prefill": {"engines": 0, "urls": [bad]}}, source="test")


def test_each_deployment_logs_engines_to_a_folder_of_its_own_by_default() -> None:
    first, second = (parse_settings({"gateway": {"port": port}}, source="t") for port in (8000, 9000))
    assert first.engine_log_dir == Path(".pdserve/logs/gateway-8000")
    assert second.engine_log_dir == Path(".pdserve/logs/gateway-9000")
    assert parse_settings({"launch": {"log_dir": "/var/log/pdserve"}}, source="t").engine_log_dir == Path(
        "/var/log/pdserve")


def test_log_format_is_text_or_json() -> None:
    assert parse_settings({}, source="t").launch.log_format == "text"
    assert parse_settings({"launch": {"log_format": "json"}}, source="t").launch.log_format == "json"
    with pytest.raises(ConfigError, match=r"launch\.log_format"):
        parse_settings({"launch": {"log_format": "xml"}}, source="t")


def test_engines_on_another_host_give_their_own_address_for_kv_and_legs() -> None:
    """On separate machines an engine bound to its link's address must also name that address to its
    peers (NIXL's side channel) and the gateway, or a decode engine elsewhere pulls from its own loopback."""
    settings = load_settings(overrides={"launch.engine_host": "10.77.0.2", "prefill.engines": 1, "decode.engines": 1})
    assert {spec.host for spec in settings.engine_specs()} == {"10.77.0.2"}
    assert settings.endpoint_urls(Role.PREFILL) == [f"http://10.77.0.2:{settings.prefill.base_port}"]
    wildcard = load_settings(overrides={"launch.engine_host": "0.0.0.0"})
    assert {spec.host for spec in wildcard.engine_specs()} == {"127.0.0.1"}


def test_a_pool_names_the_tool_call_parser_its_engines_run() -> None:
    from pdserve.engine_config import PoolSpec

    assert PoolSpec(extra_args=["--tool-call-parser", "hermes"]).tool_call_parser == "hermes"
    assert PoolSpec(extra_args=["--tool-call-parser=hermes", "--enable-auto-tool-choice"]).tool_call_parser == "hermes"
    assert PoolSpec(extra_args=["--reasoning-parser", "qwen3"]).tool_call_parser is None

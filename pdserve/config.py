"""The configuration tree's root, Settings (its sections: engine_config.py, gateway_config.py, access_config.py,
cluster_config.py):
load it (defaults < YAML file < ``PDSERVE_SECTION__FIELD`` env < flags), validate it, derive per-engine specs.
This is the only module that reads ``os.environ``; everything else receives typed objects."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import Field, ValidationError, model_validator

from pdserve.access_config import AccessSpec
from pdserve.cluster_config import EksSpec, KubernetesSpec, RaySpec
from pdserve.engine_config import EngineSpec, KVTransferSpec, LaunchSpec, ModelSpec, PoolSpec
from pdserve.errors import ConfigError
from pdserve.gateway_config import GatewaySpec, RoutingSpec
from pdserve.role import Role
from pdserve.spec_base import FrozenSpec

ENV_PREFIX = "PDSERVE_"
DECODE_BASE_PORT = 8200
DEFAULT_LOG_ROOT = Path(".pdserve/logs")


class Settings(FrozenSpec):
    model: ModelSpec = ModelSpec()
    prefill: PoolSpec = PoolSpec()
    decode: PoolSpec = PoolSpec(base_port=DECODE_BASE_PORT)
    kv: KVTransferSpec = KVTransferSpec()
    gateway: GatewaySpec = GatewaySpec()
    access: AccessSpec = AccessSpec()
    routing: RoutingSpec = RoutingSpec()
    launch: LaunchSpec = LaunchSpec()
    ray: RaySpec = RaySpec()
    kubernetes: KubernetesSpec = KubernetesSpec()
    eks: EksSpec = EksSpec()
    cache_dir: str = Field("", description="demo model cache; empty = $XDG_CACHE_HOME/pdserve")

    def pool(self, role: Role) -> PoolSpec:
        return self.prefill if role is Role.PREFILL else self.decode

    def engine_specs(self) -> list[EngineSpec]:
        """One spec per engine to launch, prefill pool first; ports and ids are unique."""
        specs: list[EngineSpec] = []
        for role in Role:
            for index in range(self.pool(role).engines):
                specs.append(self.engine_spec(role, index, side_channel_port=self.kv.side_channel_base_port + len(specs)))
        return specs

    def engine_spec(self, role: Role, index: int, *, side_channel_port: int) -> EngineSpec:
        """Engine ``index`` of ``role``'s pool (one `pdserve scale` adds past the configured count, too)."""
        pool, tp = self.pool(role), self.pool(role).tensor_parallel_size
        return EngineSpec(
            role=role, index=index, port=pool.base_port + index, side_channel_port=side_channel_port,
            gpu_ids=pool.gpu_ids[index * tp : (index + 1) * tp],
            cpu_threads_bind=pool.cpu_threads_bind[index % len(pool.cpu_threads_bind)] if pool.cpu_threads_bind else "",
            pool=pool, host=self.launch.engine_address,
        )

    def endpoint_urls(self, role: Role, *, scalable: bool = False) -> list[str]:
        """Where the gateway sends legs of ``role``: launched engines plus external urls; with
        ``scalable``, every engine `pdserve scale` may launch there too (up to max_engines_per_pool)."""
        pool = self.pool(role)
        count = max(pool.engines, self.launch.max_engines_per_pool) if scalable else pool.engines
        launched = [f"http://{self.launch.engine_address}:{pool.base_port + index}" for index in range(count)]
        return launched + list(pool.urls)

    @model_validator(mode="before")
    @classmethod
    def _decode_ports_default_apart(cls, tree: Any) -> Any:
        """``decode: {engines: 2}`` must not inherit the prefill pool's ports."""
        if isinstance(tree, dict) and isinstance(tree.get("decode"), dict) and "base_port" not in tree["decode"]:
            tree = {**tree, "decode": {**tree["decode"], "base_port": DECODE_BASE_PORT}}
        return tree

    @model_validator(mode="after")
    def _check_ports_unique(self) -> Settings:
        ports = self.local_ports
        clashes = sorted({port for port in ports if ports.count(port) > 1})
        if clashes:
            raise ValueError(f"ports used twice (gateway, engines, side channels): {clashes}")
        return self

    @property
    def local_ports(self) -> list[int]:
        """Every port this deployment binds on this host: gateway, engines, NIXL side channels."""
        ports = [self.gateway.port]
        for spec in self.engine_specs():
            ports += [spec.port, spec.side_channel_port]
        return ports

    @property
    def engine_log_dir(self) -> Path:
        """Where engines of this deployment log: ``launch.log_dir``, else a folder of its own named
        by the gateway port, which no other deployment on this host can hold at the same time."""
        return Path(self.launch.log_dir) if self.launch.log_dir else DEFAULT_LOG_ROOT / f"gateway-{self.gateway.port}"

    @property
    def run_dir(self) -> Path:
        """Where `pdserve up` and its gateway processes share the engines' states (engines/members.py)."""
        return self.engine_log_dir / "run"

    @property
    def demo_model_dir(self) -> Path:
        return Path(self.cache_dir) / "demo-model"


def load_settings(path: Path | None = None, *, overrides: Mapping[str, Any] | None = None) -> Settings:
    """Merge defaults, ``path`` (YAML), ``PDSERVE_*`` env vars and ``overrides`` into Settings.

    ``overrides`` uses dotted keys (``{"gateway.port": 9000}``). Raises ConfigError listing
    every invalid field by its path, before anything is started.
    """
    tree: dict[str, Any] = {}
    if path is not None:
        _deep_merge(tree, _read_yaml(path))
    for key, value in os.environ.items():
        if key.startswith(ENV_PREFIX) and "__" in key:
            _set_dotted(tree, key.removeprefix(ENV_PREFIX).lower().replace("__", "."), value)
    for key, value in (overrides or {}).items():
        _set_dotted(tree, key, value)
    return parse_settings(tree, source=str(path) if path else "defaults")


def parse_settings(tree: Mapping[str, Any], *, source: str) -> Settings:
    """Validate a plain dict; raises ConfigError naming each bad field path.

    An empty ``cache_dir`` becomes this host's cache, so a tree shipped to another node
    (a Ray Serve application's args) finds that node's own cache.
    """
    try:
        return Settings.model_validate({**tree, "cache_dir": tree.get("cache_dir") or _default_cache_dir()})
    except ValidationError as exc:
        problems = [
            f"  {'.'.join(str(part) for part in error['loc']) or '<root>'}: {error['msg']}"
            for error in exc.errors()
        ]
        raise ConfigError(f"invalid configuration ({source}):\n" + "\n".join(problems)) from exc


def secret_env(name: str) -> str:
    """A secret from the environment ('' if unset). Secrets never enter Settings: those are shipped
    to Ray and rendered into manifests."""
    return os.environ.get(name, "")


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        loaded = yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config file {path} is not valid YAML: {exc}") from exc
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level")
    return loaded


def _default_cache_dir() -> str:
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return str(Path(cache_home) / "pdserve")


def _deep_merge(base: dict[str, Any], extra: Mapping[str, Any]) -> None:
    for key, value in extra.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _deep_merge(base[key], value)
        else:
            base[key] = value


def _set_dotted(tree: dict[str, Any], dotted_key: str, value: Any) -> None:
    *parents, leaf = dotted_key.split(".")
    node = tree
    for part in parents:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise ConfigError(f"{dotted_key}: {part} is not a section")
        node = child
    node[leaf] = _parse_scalar(value) if isinstance(value, str) else value


def _parse_scalar(text: str) -> Any:
    """Env values are strings; YAML-parse them so lists and numbers work (``[0, 1]``)."""
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text

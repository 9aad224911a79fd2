"""The base of every part of the configuration tree (config.py, engine_config.py, gateway_config.py, cluster_config.py)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class FrozenSpec(BaseModel):
    """Read-only once loaded, and an unknown key is an error rather than a silently ignored option."""

    model_config = ConfigDict(frozen=True, extra="forbid")

"""An admin's scale request (POST /admin/scale), checked before `pdserve up` is asked to carry it
out (engines/supervisor.py). Pure."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pdserve.config import Settings
from pdserve.errors import BadRequest
from pdserve.role import Role

MAX_BODY_BYTES = 4096


def wanted_pools(body: Mapping[str, Any], *, current: Mapping[Role, int], settings: Settings) -> dict[Role, int]:
    """The pool sizes ``body`` asks for (``{"prefill": N, "decode": M}``; a pool left out stays as
    ``current``). Raises BadRequest naming the field."""
    if unknown := sorted(set(body) - {role.value for role in Role}):
        raise BadRequest(f"unknown pool {unknown[0]!r}: scale prefill or decode", param=unknown[0],
                         code="unknown_parameter")
    wanted, most = dict(current), settings.launch.max_engines_per_pool
    for role in Role:
        if role.value not in body:
            continue
        count, pool = body[role.value], settings.pool(role)
        if isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= most:
            raise BadRequest(f"{role.value} must be a whole number of engines from 0 to "
                             f"launch.max_engines_per_pool ({most})", param=role.value, code="invalid_value")
        if pool.device == "cuda" and count * pool.tensor_parallel_size > len(pool.gpu_ids):
            raise BadRequest(f"{count} {role.value} engine(s) need {count * pool.tensor_parallel_size} GPUs; "
                             f"{role.value}.gpu_ids lists {len(pool.gpu_ids)}", param=role.value, code="invalid_value")
        wanted[role] = count
    if wanted[Role.DECODE] == 0 and not settings.decode.urls:
        raise BadRequest("at least one decode engine must serve", param=Role.DECODE.value, code="invalid_value")
    return wanted

"""Can this host's NIXL load the backends a deployment asks for? Asked once, before any engine starts.

A backend plugin that cannot load (LIBFABRIC without a matching system libfabric or without libcuda)
otherwise kills every engine at start-up with a bare ``NIXL_ERR_NOT_FOUND``; NIXL names the cause only
in its debug log, which this reads.
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Sequence

_LOAD_FAILURE = re.compile(r"Failed to load plugin from \S*libplugin_(\w+)\.so: (.+)$", re.MULTILINE)
_CREATE_BACKENDS = """
import sys
from nixl._api import nixl_agent, nixl_agent_config
agent = nixl_agent("pdserve-preflight", nixl_agent_config(backends=[]))
for backend in sys.argv[1:]:
    try:
        agent.create_backend(backend, {})
    except Exception as exc:
        print(f"pdserve: backend {backend} not created: {exc}", flush=True)
"""
_NOT_CREATED = re.compile(r"^pdserve: backend (\w+) not created: (.+)$", re.MULTILINE)


def load_problems(output: str) -> dict[str, str]:
    """Backend -> why NIXL could not create it, from the preflight's output (pure)."""
    loads = dict(_LOAD_FAILURE.findall(output))
    return {backend: loads.get(backend, error) for backend, error in _NOT_CREATED.findall(output)}


async def backend_problems(
    backends: Sequence[str], *, python: str, env: dict[str, str], timeout_s: float = 120.0
) -> dict[str, str]:
    """Create each NIXL backend in a throw-away agent run by ``python`` with an engine's ``env`` added to
    this environment (as the launcher starts engines); backend -> why it failed. Raises TimeoutError
    when NIXL hangs past ``timeout_s``.
    """
    process = await asyncio.create_subprocess_exec(
        python, "-c", _CREATE_BACKENDS, *backends, env={**os.environ, **env, "NIXL_LOG_LEVEL": "DEBUG"},
        stdin=asyncio.subprocess.DEVNULL, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT,
    )
    async with asyncio.timeout(timeout_s):
        output, _ = await process.communicate()
    return load_problems(output.decode(errors="replace"))

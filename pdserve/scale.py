"""``pdserve scale``: resize the pools of a running `pdserve up` (POST /admin/scale), then follow its
engines until every start and drain is done, as `kubectl rollout status` does after `kubectl scale`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import aiohttp

from pdserve.deploy.cluster_view import format_table
from pdserve.engines.members import Members
from pdserve.errors import GatewayUnavailable
from pdserve.gateway_address import GatewayTarget
from pdserve.role import Role
from pdserve.status import admin_json

SCALE_PATH = "/admin/scale"
HEADER = ("NAME", "ROLE", "ADDRESS", "STATE")
POLL_S = 1.0


def parse_pools(args: Sequence[str]) -> dict[str, int]:
    """``["prefill=1", "decode=2"]`` as the request body. Raises ValueError saying what is wrong."""
    body: dict[str, int] = {}
    for arg in args:
        role, _, count = arg.partition("=")
        if role not in {r.value for r in Role} or not count.isdigit():
            raise ValueError(f"{arg!r}: write POOL=COUNT, with POOL prefill or decode (e.g. decode=2)")
        body[role] = int(count)
    return body


async def scale(gateway: GatewayTarget, pools: dict[str, int], *, headers: dict[str, str], wait: bool, timeout_s: float,
                progress: Callable[[str], None]) -> Members:
    """Ask for ``pools`` (none: only read the engines); with ``wait``, report each engine's state
    as it changes until the pools are as asked. Raises GatewayUnavailable, saying why."""
    async with aiohttp.ClientSession(headers=headers, timeout=aiohttp.ClientTimeout(total=30)) as session:
        if not pools:
            return Members.from_json(await admin_json(session, "GET", gateway, SCALE_PATH))
        before = Members.from_json(await admin_json(session, "GET", gateway, SCALE_PATH))
        asked = Members.from_json(await admin_json(session, "POST", gateway, SCALE_PATH, pools))
        progress("scaling " + ", ".join(f"{role.value} {before.wanted[role]} -> {count}"
                                        for role, count in asked.wanted.items()))
        if not wait:
            return asked
        return await _follow(session, gateway, wanted=asked.wanted, timeout_s=timeout_s, progress=progress)


async def _follow(session: aiohttp.ClientSession, gateway: GatewayTarget, *, wanted: dict[Role, int], timeout_s: float,
                  progress: Callable[[str], None]) -> Members:
    deadline_s = time.monotonic() + timeout_s
    states: dict[str, str] = {}
    while True:
        members = Members.from_json(await admin_json(session, "GET", gateway, SCALE_PATH))
        now = {member.name: member.state.value for member in members.engines}
        for name in sorted(states.keys() | now.keys()):
            if states.get(name) != (state := now.get(name, "stopped")):
                progress(f"  {name:<10} {state}")
        states = now
        if members.wanted == wanted and members.is_settled:
            return members
        if time.monotonic() > deadline_s:
            raise GatewayUnavailable(f"the pools are not as asked after {timeout_s:.0f} s: "
                                    + ", ".join(f"{name} {state}" for name, state in now.items()))
        await asyncio.sleep(POLL_S)


def format_members(members: Members) -> str:
    return format_table(HEADER, [(member.name, member.role.value, member.url.removeprefix("http://"),
                                  member.state.value) for member in members.engines])

"""Which launched engines take requests, and the pool sizes an admin asked for (``pdserve scale``).

`pdserve up` writes the engines and their states to ``members.json`` in the deployment's run
folder; every gateway process follows that file, and writes an admin's scale request next to
it for `pdserve up` to carry out. A file, not shared memory: the gateway is one process or
``gateway.workers`` processes, and each needs only one stat per look to see a change. Both files
are replaced whole (written aside, then renamed), so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from pdserve.role import Role

MEMBERS_FILE = "members.json"
REQUEST_FILE = "scale-request.json"


class EngineState(StrEnum):
    STARTING = "starting"  # launched, loading; not yet in rotation
    SERVING = "serving"  # in rotation
    DRAINING = "draining"  # out of rotation: what it runs finishes, then it stops


@dataclass(frozen=True, slots=True)
class Member:
    name: str
    role: Role
    url: str
    state: EngineState
    log_path: str  # where the engine logs its KV path (engines/kv_path.py)


@dataclass(frozen=True, slots=True)
class Members:
    engines: tuple[Member, ...]
    wanted: dict[Role, int]  # launched engines per pool, once every start and drain is done

    def serving(self, role: Role) -> list[Member]:
        return [member for member in self.engines if member.role is role and member.state is EngineState.SERVING]

    @property
    def is_settled(self) -> bool:
        """Every pool has the engines wanted, all serving: no start or drain under way."""
        return all(len(self.serving(role)) == count for role, count in self.wanted.items()) and all(
            member.state is EngineState.SERVING for member in self.engines)

    def to_json(self) -> dict[str, object]:
        return {"wanted": {role.value: count for role, count in self.wanted.items()},
                "engines": [{"name": m.name, "role": m.role.value, "url": m.url, "state": m.state.value,
                             "log_path": m.log_path} for m in self.engines]}

    @classmethod
    def from_json(cls, body: dict[str, object]) -> Members:
        """Raises KeyError, TypeError or ValueError for anything else than ``to_json``'s shape."""
        wanted, engines = body["wanted"], body["engines"]
        if not isinstance(wanted, dict) or not isinstance(engines, list):
            raise TypeError("members: wanted must be an object and engines a list")
        return cls(
            engines=tuple(Member(name=str(e["name"]), role=Role(e["role"]), url=str(e["url"]),
                                 state=EngineState(e["state"]), log_path=str(e["log_path"])) for e in engines),
            wanted={Role(role): int(count) for role, count in wanted.items()},
        )


@dataclass(frozen=True, slots=True)
class MembersFolder:
    """The run folder both sides share; picklable, so gateway worker processes get it as an argument."""

    path: Path

    def write(self, members: Members) -> None:
        _replace(self.path / MEMBERS_FILE, members.to_json())

    def read(self) -> Members | None:
        """The engines as `pdserve up` last wrote them; None before it has."""
        try:
            return Members.from_json(json.loads((self.path / MEMBERS_FILE).read_text()))
        except FileNotFoundError:
            return None

    def changed_since(self, stamp: float) -> float | None:
        """The members file's modification time if it is not ``stamp``, else None (one stat)."""
        try:
            mtime = (self.path / MEMBERS_FILE).stat().st_mtime_ns / 1e9
        except FileNotFoundError:
            return None
        return mtime if mtime != stamp else None

    def request_scale(self, wanted: dict[Role, int]) -> None:
        """Ask `pdserve up` for these pool sizes (a newer request replaces one not yet taken)."""
        _replace(self.path / REQUEST_FILE, {role.value: count for role, count in wanted.items()})

    def take_request(self) -> dict[Role, int] | None:
        """The pending scale request, removed as it is read; None when there is none."""
        request = self.path / REQUEST_FILE
        try:
            body = json.loads(request.read_text())
            request.unlink()
        except FileNotFoundError:
            return None
        return {Role(role): int(count) for role, count in body.items()}

    def clear(self) -> None:
        """Forget a previous run's files (a stale request must not resize a new deployment)."""
        for name in (MEMBERS_FILE, REQUEST_FILE):
            (self.path / name).unlink(missing_ok=True)


def _replace(path: Path, body: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    aside = path.with_name(f".{path.name}.{os.getpid()}")
    aside.write_text(json.dumps(body))
    aside.replace(path)

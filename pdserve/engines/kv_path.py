"""The KV path an engine took, read back from its log: NIXL backends, UCX transports, libfabric provider,
and where pdserve put its KV buffer. Parsing is pure; ``KvPathLog`` only reads a growing file.

Local engines and Ray replicas report through the same reader, so the gateway, ``/metrics`` and
``pdserve verify`` see one shape wherever the engine runs.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

# Lines pdserve writes at the top of an engine's log (engines/launcher.py) to say what it chose.
NOTE_PREFIX = "=== pdserve: "
BUFFER_NOTE = "kv buffer"
PROVIDER_NOTE = "libfabric provider"

_BACKEND = re.compile(r"Backend (\w+) was instantiated")
# UCX_PROTO_INFO=y prints a table per protocol: a title row, then "| range | description | transports |".
_UCX_TITLE = re.compile(r"\| (.+ by ucp_\w+.*?)\s*\|\s*$")
_UCX_ROW = re.compile(r"\|\s*\S*\.\.\S*\s*\|\s*([^|]+?)\s*\|\s*([^|]+?)\s*\|")
_BUFFER = re.compile(re.escape(NOTE_PREFIX + BUFFER_NOTE) + r" (\w+): (.+)$")
# NIXL's LIBFABRIC plugin names the provider it opened once its rails exist: ``NIXL_INFO << "Created " <<
# rails_.size() << " rails using provider=" << selected_provider_name`` (ai-dynamo/nixl
# src/utils/libfabric/libfabric_rail_manager.cpp, the rail manager's constructor; INFO since NIXL 1.1, a
# DEBUG "Successfully created N rails using provider=" in 1.0). NIXL's C++ logs print at NIXL_LOG_LEVEL=INFO
# and above only (src/utils/common/nixl_log.cpp: the default is WARN), which kv_link.libfabric_env sets.
OPENED_PROVIDER = re.compile(r"\d+ rails using provider=([\w-]+)")


@dataclass(frozen=True, slots=True)
class KvPath:
    backends: tuple[str, ...] = ()  # NIXL backends instantiated
    transports: tuple[str, ...] = ()  # UCX transports chosen for KV reads
    provider: str = ""  # libfabric provider the LIBFABRIC backend said it opened; "" when it did not say
    buffer_device: str = ""  # where the KV buffer lives (kv_buffer_device)
    buffer_reason: str = ""  # why pdserve chose it


def is_kv_path_line(line: str) -> bool:
    """Whether ``kv_path_from_log`` needs this log line (so a reader can keep only those)."""
    return bool(_BACKEND.search(line) or _UCX_TITLE.search(line) or _UCX_ROW.search(line)
                or _BUFFER.search(line) or OPENED_PROVIDER.search(line))


def kv_path_from_log(log_text: str) -> KvPath:
    """The KV path as an engine logged it; the last start in the log wins for pdserve's own notes.

    vLLM's decode engine pulls the KV cache, so the reads (``ucp_get``) are the transports that matter.
    The provider is only ever the one NIXL says it opened: pdserve's own note of the ``FI_PROVIDER`` it
    set is what it asked for, not what libfabric gave (and a pool's env may override it), so without
    NIXL's line the provider is "" (not reported).
    """
    backends = tuple(sorted(set(_BACKEND.findall(log_text))))
    reads: set[str] = set()
    is_read_table = False
    buffer_device = buffer_reason = opened = ""
    for line in log_text.splitlines():
        if title := _UCX_TITLE.search(line):
            is_read_table = "read by ucp_get" in title.group(1)
        elif is_read_table and (row := _UCX_ROW.search(line)):
            reads.add(f"{row.group(2)} ({row.group(1)})")
        elif buffer := _BUFFER.search(line):
            buffer_device, buffer_reason = buffer.group(1), buffer.group(2).strip()
        elif provider := OPENED_PROVIDER.search(line):
            opened = provider.group(1)
    return KvPath(backends=backends, transports=tuple(sorted(reads)),
                  provider=opened if "LIBFABRIC" in backends else "",
                  buffer_device=buffer_device, buffer_reason=buffer_reason)


class KvPathLog:
    """An engine's KV path, read as its log grows; keeps only the lines that tell it."""

    def __init__(self, path: Path) -> None:
        self._path, self._offset = path, 0
        self._kept: list[str] = []

    def read(self) -> KvPath:
        with contextlib.suppress(OSError), self._path.open("rb") as log:
            log.seek(self._offset)
            chunk = log.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offset += len(complete)
            self._kept += [line for line in complete.decode(errors="replace").splitlines() if is_kv_path_line(line)]
        return kv_path_from_log("\n".join(self._kept))

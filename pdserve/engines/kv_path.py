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
_REQUESTED_PROVIDER = re.compile(re.escape(NOTE_PREFIX + PROVIDER_NOTE) + r" (\S+):")
# NIXL's LIBFABRIC plugin names the provider of its rails at debug level (NIXL_LOG_LEVEL=DEBUG).
_OPENED_PROVIDER = re.compile(r"rails? .*provider=(\w[\w-]*)")


@dataclass(frozen=True, slots=True)
class KvPath:
    backends: tuple[str, ...] = ()  # NIXL backends instantiated
    transports: tuple[str, ...] = ()  # UCX transports chosen for KV reads
    provider: str = ""  # libfabric provider of the LIBFABRIC backend; "" when it has none
    buffer_device: str = ""  # where the KV buffer lives (kv_buffer_device)
    buffer_reason: str = ""  # why pdserve chose it


def is_kv_path_line(line: str) -> bool:
    """Whether ``kv_path_from_log`` needs this log line (so a reader can keep only those)."""
    return bool(_BACKEND.search(line) or _UCX_TITLE.search(line) or _UCX_ROW.search(line)
                or _BUFFER.search(line) or _REQUESTED_PROVIDER.search(line) or _OPENED_PROVIDER.search(line))


def kv_path_from_log(log_text: str) -> KvPath:
    """The KV path as an engine logged it; the last start in the log wins for pdserve's own notes.

    vLLM's decode engine pulls the KV cache, so the reads (``ucp_get``) are the transports that matter.
    The provider is the one NIXL says it opened, else the one pdserve pinned with ``FI_PROVIDER``
    (a LIBFABRIC backend that could not open it is never instantiated).
    """
    backends = tuple(sorted(set(_BACKEND.findall(log_text))))
    reads: set[str] = set()
    is_read_table = False
    buffer_device = buffer_reason = requested = opened = ""
    for line in log_text.splitlines():
        if title := _UCX_TITLE.search(line):
            is_read_table = "read by ucp_get" in title.group(1)
        elif is_read_table and (row := _UCX_ROW.search(line)):
            reads.add(f"{row.group(2)} ({row.group(1)})")
        elif buffer := _BUFFER.search(line):
            buffer_device, buffer_reason = buffer.group(1), buffer.group(2).strip()
        elif provider := _REQUESTED_PROVIDER.search(line):
            requested = provider.group(1)
        elif provider := _OPENED_PROVIDER.search(line):
            opened = provider.group(1)
    provider_name = (opened or requested) if "LIBFABRIC" in backends else ""
    return KvPath(backends=backends, transports=tuple(sorted(reads)), provider=provider_name,
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

"""Pure: why an engine failed, from the end of its log: the exception vLLM's "See root cause above" points
to, and what pdserve advises for the causes it knows. ``pdserve up``, ``ray up`` and ``cloud status``
(Serve's deployment message) all read it through ``root_cause``. No I/O.

vLLM's engine core runs in a process of its own: when it cannot start it logs "EngineCore failed to
start." with its traceback (vllm/v1/engine/core.py, run_engine_core), and the API server then fails
with RuntimeError "Engine core initialization failed. See root cause above. ..." (vllm/v1/engine/utils.py,
wait_for_engine_startup), whose traceback ends the log and says nothing of the cause.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# "(EngineCore pid=2412) " / "(APIServer pid=2301) " (vllm/utils/system_utils.py _add_prefix in 0.26; the log
# format's own "(%(vllm_process_name)s pid=%(process)d) " in 0.32), then vLLM's "ERROR 12-06 01:52:07
# [core.py:1330] " (vllm/logger.py _FORMAT), each optional; ANSI colours where a terminal was assumed.
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PROCESS_PREFIX = re.compile(r"^\([\w.:-]+ pid=\d+\) ")
_LOG_PREFIX = re.compile(r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) \d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]+\] ")
_ENGINE_CORE_FAILED = ("EngineCore failed to start.", "EngineCore encountered a fatal error.")
_TRACEBACK = "Traceback (most recent call last):"
_FRAME = re.compile(r'^  File "(?P<path>[^"]+)", line (?P<line>\d+), in (?P<function>.+)$')
# An exception line: a (dotted) class name, then ": message" or nothing.
_EXCEPTION = re.compile(r"^[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt|Failure|Warning)\b(?::.*)?$")
# vLLM's own summary of a failed start: never the cause.
SEE_ROOT_CAUSE = "See root cause above"


@dataclass(frozen=True, slots=True)
class RootCause:
    line: str  # the exception line, e.g. "ValueError: max_num_seqs (1024) exceeds ..."
    function: str = ""  # where it was raised: the innermost frame of its traceback
    path: str = ""
    lineno: int = 0

    @property
    def summary(self) -> str:
        """The exception line and where it was raised, on one line."""
        if not self.function:
            return self.line
        return f"{self.line} (in {self.function}, {_short_path(self.path)}:{self.lineno})"


def root_cause(log_text: str) -> RootCause | None:
    """The exception that stopped the engine, from the end of its log: the engine core's traceback
    after "EngineCore failed to start." when there is one, else the last exception in the log that is
    not vLLM's "See root cause above". None when the log holds no traceback's exception line."""
    lines = [plain_line(line) for line in log_text.splitlines()]
    core_failed = [index for index, line in enumerate(lines) if line in _ENGINE_CORE_FAILED]
    if core_failed:
        cause = _first_exception(lines[core_failed[-1]:])
        if cause is not None:
            return cause
    causes = [cause for start in _traceback_starts(lines)
              if (cause := _first_exception(lines[start:])) is not None and SEE_ROOT_CAUSE not in cause.line]
    return causes[-1] if causes else None


def plain_line(line: str) -> str:
    """A log line without vLLM's process and log-record prefixes and the "\\r" its formatter leaves."""
    line = _ANSI.sub("", line).rstrip("\r\n")
    line = _PROCESS_PREFIX.sub("", line, count=1)
    return _LOG_PREFIX.sub("", line, count=1)


# (what the root cause line or its function holds, pdserve's advice)
_ADVICE = (
    ("exceeds available Mamba cache blocks",
     ("the engine's KV cache holds fewer Mamba state blocks than max_num_seqs: give the pool a max_num_seqs that "
     "fits (pdserve sizes it itself where it knows the KV cache size: kv_cache_gib on CPU; on GPU "
     "--kv-cache-memory-bytes, or the GPU's share less the weights) or more KV cache memory")),
    ("initialize_host_xfer_buffer",
     ("vLLM's own NixlConnector cannot stage a hybrid model's KV cache in host memory (its cache is a list of "
     "state tensors per layer group); pdserve's engines load pdserve_vllm.hybrid_connector for it, so an engine "
     "that fails here was started with another kv_connector_module_path: drop it, or set kv.buffer_device: cuda")),
    ("less than desired GPU memory utilization",
     "engines sharing a GPU each ask for their gpu_memory_utilization of the whole GPU: keep their sum below 1"),
    ("OutOfMemoryError",
     ("the GPU ran out of memory: lower gpu_memory_utilization, the KV cache (--kv-cache-memory-bytes) or "
     "model.max_model_len, or set enforce_eager")),
)


def advice(cause: RootCause) -> str:
    """What pdserve advises for a root cause it knows; '' for others."""
    for needle, text in _ADVICE:
        if needle in cause.line or needle == cause.function:
            return text
    return ""


def describe_failure(log_text: str) -> str:
    """The root cause as the start of an error message, its advice on the next line; '' when the log
    holds none."""
    cause = root_cause(log_text)
    if cause is None:
        return ""
    fix = advice(cause)
    return cause.summary + (f"\n  fix: {fix}" if fix else "")


def _traceback_starts(lines: list[str]) -> list[int]:
    return [index for index, line in enumerate(lines) if line == _TRACEBACK]


def _first_exception(lines: list[str]) -> RootCause | None:
    """The exception line ending the first traceback in ``lines``, with the innermost frame before it."""
    frame: re.Match[str] | None = None
    in_traceback = False
    for line in lines:
        if line == _TRACEBACK:
            in_traceback = True
        elif in_traceback and (match := _FRAME.match(line)):
            frame = match
        elif in_traceback and line and not line[0].isspace():
            if not _EXCEPTION.match(line):
                return None
            if frame is None:
                return RootCause(line=line)
            return RootCause(line=line, function=frame["function"], path=frame["path"], lineno=int(frame["line"]))
    return None


def _short_path(path: str) -> str:
    """``.../site-packages/vllm/config/compilation.py`` as ``vllm/config/compilation.py``."""
    for package in ("/vllm/", "/pdserve/", "/pdserve_vllm/"):
        if package in path:
            return package.lstrip("/") + path.rsplit(package, 1)[1]
    return path

"""What a starting vLLM engine is doing, read from its log: loading weights, compiling, capturing CUDA
graphs. vLLM prints nothing for minutes while torch.compile runs on a first start; this names the phase
and how long it has lasted, so a wait is never silent. Parsing is pure; ``StartPhaseLog`` only reads a
growing file.
"""

from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from pathlib import Path

# vLLM's own log lines (vllm/v1/worker/*model_runner.py, compilation/backends.py and monitor.py,
# v1/engine/core.py, entrypoints/openai/api_server.py), in the order a start goes through them.
_PHASES = (
    (re.compile(r"Starting to load model|Loading model from scratch"), "loading weights"),
    (re.compile(r"Loading weights took|Model loading took"), "weights loaded"),
    (re.compile(r"Directly load the compiled graph"), "loading compiled graphs from the cache"),
    (re.compile(r"Starting torch\.compile|Dynamo bytecode transform time|Compiling a graph for"),
     "compiling the model (torch.compile; a first start only)"),
    (re.compile(r"torch\.compile took"), "compiled"),
    # vLLM 0.26's V1 model runner then logged nothing for 2 minutes on a fresh H200 machine, twice (docs/benchmarks.md,
    # section 5); its V2 runner, on the same machine after that, 1 s.
    (re.compile(r"Initial profiling/warmup run took"), "warming up after the profiling run (vLLM logs nothing here)"),
    (re.compile(r"Available KV cache memory|GPU KV cache size"), "sizing the KV cache"),
    (re.compile(r"Capturing CUDA graphs"), "capturing CUDA graphs"),
    (re.compile(r"Graph capturing finished"), "CUDA graphs captured"),
    (re.compile(r"init engine \(profile, create kv cache, warmup model\) took"), "engine ready, starting the API server"),
    (re.compile(r"Application startup complete"), "API server up"),
)
STARTING = "starting the server"
COMPILING = _PHASES[3][1]


def phase_of_line(line: str) -> str | None:
    """The phase a vLLM log line starts, or None for any other line."""
    return next((phase for pattern, phase in _PHASES if pattern.search(line)), None)


@dataclass(frozen=True, slots=True)
class PhaseChange:
    phase: str
    at_s: float  # when the reader saw it (the caller's clock)


class StartPhaseLog:
    """An engine's start phase, read as its log grows; remembers when the phase last changed."""

    def __init__(self, path: Path, *, now_s: float) -> None:
        self._path, self._offset = path, _size(path)  # a restarted engine appends: only its own lines count
        self.current = PhaseChange(STARTING, now_s)

    def read(self, *, now_s: float) -> PhaseChange:
        with contextlib.suppress(OSError), self._path.open("rb") as log:
            log.seek(self._offset)
            chunk = log.read()
            complete = chunk[: chunk.rfind(b"\n") + 1]
            self._offset += len(complete)
            for line in complete.decode(errors="replace").splitlines():
                phase = phase_of_line(line)
                if phase is not None and phase != self.current.phase:
                    self.current = PhaseChange(phase, now_s)
        return self.current


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0

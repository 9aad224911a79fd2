"""What one microbenchmark transfer is: the path it takes, the plan of blocks it moves, its result,
and the byte pattern that proves every byte arrived.

Data and pure helpers only (numpy; torch is passed in), shared by the microbenchmark's driver
(microbench.py) and its NIXL agent processes (nixl_pair.py), which import this and not each other.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

import numpy as np

SEED = 1 << 40  # added to each int64 word index: every word of the source is unique and never 0 or -1
POISON = -1
WORD_BYTES = 8
VLLM_NIXL_THREADS = 4  # what vLLM's NixlConnector gives the UCX backend (kv_connector_extra_config num_threads)


class PathKind(enum.Enum):
    HOST_MEMCPY = "host-memcpy"
    NIXL_DRAM = "nixl-dram"
    DEVICE_COPY = "device-copy"
    PINNED_H2D = "pinned-h2d"
    PINNED_D2H = "pinned-d2h"
    CUDA_IPC = "cuda-ipc"  # one copy out of a tensor another process shared (torch.multiprocessing)
    CUDA_IPC_GATHER = "cuda-ipc-gather"  # the same, gathering scattered blocks in one kernel
    NIXL_VRAM = "nixl-vram"


class Operation(enum.Enum):
    READ = "READ"  # the decode side pulls (vLLM's NixlConnector / NixlPullConnector)
    WRITE = "WRITE"  # the prefill side pushes (vLLM's NixlPushConnector)


NIXL_KINDS = frozenset({PathKind.NIXL_DRAM, PathKind.NIXL_VRAM})


@dataclass(frozen=True, slots=True)
class Path:
    """One way to move the bytes. `env` (name, value) pairs are set in both agents' processes before NIXL loads."""

    kind: PathKind
    operation: Operation = Operation.READ
    backend: str = "UCX"
    num_threads: int = VLLM_NIXL_THREADS
    env: tuple[tuple[str, str], ...] = ()

    @property
    def label(self) -> str:
        if self.kind not in NIXL_KINDS:
            return self.kind.value
        threads = [] if self.num_threads == VLLM_NIXL_THREADS else [f"threads={self.num_threads}"]
        options = " ".join([*threads, *(f"{name}={value}" for name, value in self.env)])
        return f"{self.kind.value} {self.operation.value} {self.backend} {options}".strip()


@dataclass(frozen=True, slots=True)
class TransferResult:
    path: Path
    size_bytes: int
    seconds: float  # median of the timed repeats; inf when the path failed
    descriptors: int
    is_verified: bool  # every destination word checked against the source
    limit_gbps: float | None = None
    error: str | None = None

    @property
    def gbps(self) -> float:
        return self.size_bytes / self.seconds / 1e9

    @property
    def ratio(self) -> float | None:
        return None if self.limit_gbps is None else self.gbps / self.limit_gbps


@dataclass(frozen=True, slots=True)
class Plan:
    size_bytes: int
    block_bytes: int
    repeats: int
    timeout_s: float

    @property
    def n_words(self) -> int:
        return self.size_bytes // WORD_BYTES

    @property
    def n_blocks(self) -> int:
        return self.size_bytes // self.block_bytes

    @property
    def words_per_block(self) -> int:
        return self.block_bytes // WORD_BYTES

    def permutation(self) -> np.ndarray:
        """Destination block i receives source block permutation()[i]: scattered ids, like KV blocks."""
        return np.random.default_rng(7).permutation(self.n_blocks).astype(np.int64)


def expected_blocks(plan: Plan) -> np.ndarray:
    perm = plan.permutation()
    words = np.arange(plan.words_per_block, dtype=np.int64)
    return perm[:, None] * plan.words_per_block + words[None, :] + SEED


def pattern_torch(torch: Any, n_words: int, device: str) -> Any:
    pattern = torch.arange(n_words, dtype=torch.int64, device=device) + SEED
    return pattern.pin_memory() if device == "cpu" else pattern

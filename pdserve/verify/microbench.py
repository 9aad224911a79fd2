"""Raw KV-transfer microbenchmark: the machine's copy limits and NIXL agent-to-agent transfers, measured in one run.

No model and no vLLM. NIXL paths run two agents in two spawned processes, as a prefill and a decode engine do,
and move the bytes as many block-sized descriptors with scattered block ids (so NIXL cannot merge them), then
check every byte that arrived. Imports only numpy at module level, so it runs as a plain script on a bare GPU
machine (`python3 pdserve/verify/microbench.py --help`); torch and nixl load only for the paths that need them.
"""

from __future__ import annotations

import argparse
import enum
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

_SEED = 1 << 40  # added to each int64 word index: every word of the source is unique and never 0 or -1
_POISON = -1
_WORD_BYTES = 8
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


# Which measured hardware path bounds each path (None: the path is itself a hardware limit).
LIMIT_OF: dict[PathKind, PathKind | None] = {
    PathKind.HOST_MEMCPY: None,
    PathKind.NIXL_DRAM: PathKind.HOST_MEMCPY,
    PathKind.DEVICE_COPY: None,
    PathKind.PINNED_H2D: None,
    PathKind.PINNED_D2H: None,
    PathKind.CUDA_IPC: PathKind.DEVICE_COPY,
    PathKind.CUDA_IPC_GATHER: PathKind.DEVICE_COPY,
    PathKind.NIXL_VRAM: PathKind.DEVICE_COPY,
}
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


def parse_path(text: str) -> Path:
    """Parse 'KIND [op=READ|WRITE] [backend=UCX] [threads=N] [ENV=VALUE ...]' (space-separated); raises ValueError."""
    kind_text, *tokens = text.split()
    path = Path(kind=PathKind(kind_text))
    env: list[tuple[str, str]] = []
    for token in tokens:
        name, sep, value = token.partition("=")
        if not sep:
            raise ValueError(f"path option {token!r} is not NAME=VALUE")
        if name == "op":
            path = replace(path, operation=Operation(value.upper()))
        elif name == "backend":
            path = replace(path, backend=value)
        elif name == "threads":
            path = replace(path, num_threads=int(value))
        else:
            env.append((name, value))
    if (env or tokens) and path.kind not in NIXL_KINDS:
        raise ValueError(f"options apply to NIXL paths only, not {path.kind.value}")
    return replace(path, env=tuple(env))


def default_paths(*, has_cuda: bool) -> list[Path]:
    kinds = list(PathKind) if has_cuda else [PathKind.HOST_MEMCPY, PathKind.NIXL_DRAM]
    return [Path(kind=kind) for kind in kinds]


def run_microbench(
    *, size_bytes: int, block_bytes: int, paths: Sequence[Path], repeats: int = 5, timeout_s: float = 120.0
) -> list[TransferResult]:
    """Measure each path moving `size_bytes` in `block_bytes` descriptors; hardware limits it needs are added first.

    Raises ValueError for sizes that are not whole blocks of whole 8-byte words. A NIXL path that fails or
    times out comes back with `error` set and `seconds` inf, so one bad backend does not hide the others.
    """
    if block_bytes <= 0 or block_bytes % _WORD_BYTES or size_bytes % block_bytes:
        raise ValueError(f"size_bytes={size_bytes} must be a multiple of block_bytes={block_bytes}, itself of 8")
    plan = _Plan(size_bytes=size_bytes, block_bytes=block_bytes, repeats=max(repeats, 1), timeout_s=timeout_s)
    needed = {LIMIT_OF[p.kind] for p in paths}
    references = [Path(kind=kind) for kind in PathKind if kind in needed]
    ordered = [r for r in references if r not in paths] + list(paths)
    measured = [_MEASURE[path.kind](path, plan) for path in ordered]
    gbps_of = {r.path.kind: r.gbps for r in measured if LIMIT_OF[r.path.kind] is None and r.error is None}
    return [_with_limit(r, gbps_of) for r in measured]


def format_table(results: Sequence[TransferResult]) -> str:
    """Render results as a fixed-width text table, one row per path."""
    header = f"{'path':<72} {'MB':>8} {'descs':>6} {'seconds':>9} {'GB/s':>9} {'limit':>8} {'ratio':>7}  ok"
    rows = [header, "-" * len(header)]
    for r in results:
        limit = "-" if r.limit_gbps is None else f"{r.limit_gbps:.1f}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.3f}"
        ok = "yes" if r.is_verified else ("ERR " + (r.error or "")[:60] if r.error else "no")
        rows.append(
            f"{r.path.label[:72]:<72} {r.size_bytes / 1e6:>8.1f} {r.descriptors:>6} {r.seconds:>9.4f} "
            f"{r.gbps:>9.2f} {limit:>8} {ratio:>7}  {ok}"
        )
    return "\n".join(rows)


@dataclass(frozen=True, slots=True)
class _Plan:
    size_bytes: int
    block_bytes: int
    repeats: int
    timeout_s: float

    @property
    def n_words(self) -> int:
        return self.size_bytes // _WORD_BYTES

    @property
    def n_blocks(self) -> int:
        return self.size_bytes // self.block_bytes

    @property
    def words_per_block(self) -> int:
        return self.block_bytes // _WORD_BYTES

    def permutation(self) -> np.ndarray:
        """Destination block i receives source block permutation()[i]: scattered ids, like KV blocks."""
        return np.random.default_rng(7).permutation(self.n_blocks).astype(np.int64)


def _with_limit(result: TransferResult, gbps_of: dict[PathKind, float]) -> TransferResult:
    limit_kind = LIMIT_OF[result.path.kind]
    return result if limit_kind is None else replace(result, limit_gbps=gbps_of.get(limit_kind))


def _expected_blocks(plan: _Plan) -> np.ndarray:
    perm = plan.permutation()
    words = np.arange(plan.words_per_block, dtype=np.int64)
    return perm[:, None] * plan.words_per_block + words[None, :] + _SEED


def _measure_host_memcpy(path: Path, plan: _Plan) -> TransferResult:
    src = np.arange(plan.n_words, dtype=np.int64) + _SEED
    dst = np.full(plan.n_words, _POISON, dtype=np.int64)
    np.copyto(dst, src)  # warm-up: page faults stay out of the timing
    samples = []
    for _ in range(plan.repeats):
        start = time.perf_counter()
        np.copyto(dst, src)
        samples.append(time.perf_counter() - start)
    return TransferResult(path, plan.size_bytes, statistics.median(samples), 1, bool(np.array_equal(dst, src)))


def _time_cuda(torch: Any, repeats: int, copy: Callable[[], object]) -> float:
    copy()
    torch.cuda.synchronize()
    samples: list[float] = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        copy()
        end.record()
        end.synchronize()
        samples.append(float(start.elapsed_time(end)) / 1e3)
    return statistics.median(samples)


def _measure_cuda_local(path: Path, plan: _Plan) -> TransferResult:
    import torch

    on_device = {PathKind.DEVICE_COPY: ("cuda", "cuda"), PathKind.PINNED_H2D: ("cpu", "cuda")}
    src_device, dst_device = on_device.get(path.kind, ("cuda", "cpu"))
    src = _pattern_torch(torch, plan.n_words, src_device)
    dst = torch.full((plan.n_words,), _POISON, dtype=torch.int64, device=dst_device, pin_memory=dst_device == "cpu")
    seconds = _time_cuda(torch, plan.repeats, lambda: dst.copy_(src, non_blocking=True))
    return TransferResult(path, plan.size_bytes, seconds, 1, bool(torch.equal(dst.cpu(), src.cpu())))


def _pattern_torch(torch: Any, n_words: int, device: str) -> Any:
    pattern = torch.arange(n_words, dtype=torch.int64, device=device) + _SEED
    return pattern.pin_memory() if device == "cpu" else pattern


def _share_cuda_pattern(queue: Any, finished: Any, n_words: int) -> None:
    import torch
    import torch.multiprocessing  # registers the reductions that send CUDA tensors as IPC handles

    pattern = _pattern_torch(torch, n_words, "cuda")  # held until the consumer is done with its mapping
    queue.put(pattern)
    finished.wait()


def _measure_cuda_ipc(path: Path, plan: _Plan) -> TransferResult:
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    queue, finished = ctx.Queue(), ctx.Event()
    producer = ctx.Process(target=_share_cuda_pattern, args=(queue, finished, plan.n_words), daemon=True)
    producer.start()
    try:
        shared = queue.get(timeout=plan.timeout_s)
        dst = torch.full((plan.n_words,), _POISON, dtype=torch.int64, device="cuda")
        if path.kind is PathKind.CUDA_IPC:
            seconds = _time_cuda(torch, plan.repeats, lambda: dst.copy_(shared))
            return TransferResult(path, plan.size_bytes, seconds, 1, bool(torch.equal(dst, shared)))
        perm = torch.from_numpy(plan.permutation()).cuda()
        src_blocks, dst_blocks = shared.view(plan.n_blocks, -1), dst.view(plan.n_blocks, -1)
        seconds = _time_cuda(torch, plan.repeats, lambda: torch.index_select(src_blocks, 0, perm, out=dst_blocks))
        expected = torch.from_numpy(_expected_blocks(plan)).cuda()
        return TransferResult(path, plan.size_bytes, seconds, plan.n_blocks, bool(torch.equal(dst_blocks, expected)))
    finally:
        finished.set()
        producer.join(timeout=10)


def _measure_nixl(path: Path, plan: _Plan) -> TransferResult:
    """Run a target agent and an initiator agent in two spawned processes; this process only relays metadata."""
    ctx = mp.get_context("spawn")
    target_conn, target_end = ctx.Pipe()
    initiator_conn, initiator_end = ctx.Pipe()
    target = ctx.Process(target=_run_agent, args=(target_end, path, plan, False), daemon=True)
    initiator = ctx.Process(target=_run_agent, args=(initiator_end, path, plan, True), daemon=True)
    target.start()
    initiator.start()
    try:
        initiator_conn.send(_receive(target_conn, plan.timeout_s))
        seconds, descriptors, initiator_ok = _receive(initiator_conn, plan.timeout_s)
        target_conn.send("finish")
        target_ok = _receive(target_conn, plan.timeout_s)
        return TransferResult(path, plan.size_bytes, seconds, descriptors, bool(initiator_ok and target_ok))
    except (RuntimeError, TimeoutError, EOFError) as exc:
        return TransferResult(path, plan.size_bytes, float("inf"), plan.n_blocks, False, error=str(exc))
    finally:
        for process in (initiator, target):
            process.join(timeout=5)
            if process.is_alive():
                process.kill()


def _receive(conn: mpc.Connection, timeout_s: float) -> Any:
    if not conn.poll(timeout_s):
        raise TimeoutError(f"no answer from a NIXL agent process within {timeout_s:.0f} s")
    is_ok, payload = conn.recv()
    if not is_ok:
        raise RuntimeError(payload)
    return payload


def _run_agent(conn: mpc.Connection, path: Path, plan: _Plan, is_initiator: bool) -> None:
    """One agent process: the target serves its buffer, the initiator posts the transfers and times them."""
    try:
        os.environ.update(dict(path.env))  # before NIXL loads: UCX reads its configuration when the backend starts
        agent = _Agent(path, plan, name="initiator" if is_initiator else "target")
        is_source = is_initiator == (path.operation is Operation.WRITE)
        agent.fill(is_source=is_source)
        if is_initiator:
            remote_metadata, remote_address = conn.recv()
            seconds = agent.time_transfers(remote_metadata, remote_address)
            conn.send((True, (seconds, plan.n_blocks, is_source or agent.is_correct())))
        else:
            conn.send((True, (agent.metadata(), agent.address)))
            conn.recv()
            conn.send((True, is_source or agent.is_correct()))
    except Exception as exc:  # reported to the parent, which records the path as failed
        conn.send((False, f"{type(exc).__name__}: {exc}"))
        raise


class _Agent:
    """A NIXL agent that owns one registered buffer of the plan's size, in DRAM (numpy) or VRAM (torch)."""

    def __init__(self, path: Path, plan: _Plan, *, name: str) -> None:
        from nixl._api import nixl_agent, nixl_agent_config

        self.path, self.plan = path, plan
        self.is_vram = path.kind is PathKind.NIXL_VRAM
        self.buffer: Any  # np.ndarray in DRAM, torch.Tensor in VRAM
        self.torch: Any = None
        self.mem_type = "VRAM" if self.is_vram else "DRAM"
        if self.is_vram:
            import torch

            self.torch = torch
            self.buffer = torch.full((plan.n_words,), _POISON, dtype=torch.int64, device="cuda")
            self.address, self.device_id = self.buffer.data_ptr(), self.buffer.device.index or 0
        else:
            self.buffer = np.full(plan.n_words, _POISON, dtype=np.int64)
            self.address, self.device_id = self.buffer.ctypes.data, 0
        config = nixl_agent_config(backends=[path.backend], num_threads=path.num_threads)
        self.agent = nixl_agent(name, config)
        regions = [(self.address, plan.size_bytes, self.device_id, "")]
        self.agent.register_memory(self.agent.get_reg_descs(regions, self.mem_type), backends=[path.backend])

    def metadata(self) -> bytes:
        return bytes(self.agent.get_agent_metadata())

    def fill(self, *, is_source: bool) -> None:
        if is_source and self.is_vram:
            self.buffer.copy_(_pattern_torch(self.torch, self.plan.n_words, "cuda"))
            self.torch.cuda.synchronize()
        elif is_source:
            self.buffer[:] = np.arange(self.plan.n_words, dtype=np.int64) + _SEED

    def descriptors(self, address: int) -> np.ndarray:
        out = np.empty((self.plan.n_blocks, 3), dtype=np.uint64)
        out[:, 0] = address + np.arange(self.plan.n_blocks, dtype=np.uint64) * self.plan.block_bytes
        out[:, 1] = self.plan.block_bytes
        out[:, 2] = self.device_id
        return out

    def time_transfers(self, remote_metadata: bytes, remote_address: int) -> float:
        """Warm up once (connection, memory-handle mapping), then time make_prepped_xfer + post + completion."""
        remote_name = self.agent.add_remote_agent(remote_metadata)
        local = self.agent.prep_xfer_dlist("NIXL_INIT_AGENT", self.descriptors(self.address), self.mem_type)
        remote = self.agent.prep_xfer_dlist(remote_name, self.descriptors(remote_address), self.mem_type)
        perm = self.plan.permutation().astype(np.int32)
        identity = np.arange(self.plan.n_blocks, dtype=np.int32)
        # Destination block i always receives source block perm[i].
        local_ids, remote_ids = (identity, perm) if self.path.operation is Operation.READ else (perm, identity)
        samples = []
        for repeat in range(self.plan.repeats + 1):
            start = time.perf_counter()
            handle = self.agent.make_prepped_xfer(self.path.operation.value, local, local_ids, remote, remote_ids)
            state = self.agent.transfer(handle)
            while state == "PROC":
                state = self.agent.check_xfer_state(handle)
            if state != "DONE":
                raise RuntimeError(f"NIXL transfer ended in state {state}")
            samples.append(time.perf_counter() - start)
            handle.release()
            if time.perf_counter() - start > self.plan.timeout_s / (self.plan.repeats + 1):
                break  # a path this slow gets one timed sample rather than a timeout
        return statistics.median(samples[1:] or samples)

    def is_correct(self) -> bool:
        expected = _expected_blocks(self.plan)
        if self.is_vram:
            received = self.buffer.view(self.plan.n_blocks, -1)
            return bool(self.torch.equal(received, self.torch.from_numpy(expected).to(received.device)))
        return bool(np.array_equal(self.buffer.reshape(self.plan.n_blocks, -1), expected))


_MEASURE: dict[PathKind, Callable[[Path, _Plan], TransferResult]] = {
    PathKind.HOST_MEMCPY: _measure_host_memcpy,
    PathKind.NIXL_DRAM: _measure_nixl,
    PathKind.DEVICE_COPY: _measure_cuda_local,
    PathKind.PINNED_H2D: _measure_cuda_local,
    PathKind.PINNED_D2H: _measure_cuda_local,
    PathKind.CUDA_IPC: _measure_cuda_ipc,
    PathKind.CUDA_IPC_GATHER: _measure_cuda_ipc,
    PathKind.NIXL_VRAM: _measure_nixl,
}


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=float, default=452.0, help="bytes per transfer, in MB (10^6)")
    parser.add_argument("--block-kb", type=float, default=32.0, help="bytes per descriptor, in KB (2^10)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--timeout-s", type=float, default=120.0)
    parser.add_argument(
        "--path", action="append", default=[], help="'KIND [op=READ|WRITE] [backend=UCX] [threads=N] [ENV=VALUE...]'"
    )
    args = parser.parse_args(argv)
    block_bytes = int(args.block_kb * 1024) // _WORD_BYTES * _WORD_BYTES
    size_bytes = max(int(args.size_mb * 1e6) // block_bytes, 1) * block_bytes
    paths = [parse_path(text) for text in args.path] or default_paths(has_cuda=_has_cuda())
    results = run_microbench(
        size_bytes=size_bytes, block_bytes=block_bytes, paths=paths, repeats=args.repeats, timeout_s=args.timeout_s
    )
    print(format_table(results), flush=True)
    return 0 if all(r.is_verified for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

"""Raw KV-transfer microbenchmark: the machine's copy limits and NIXL agent-to-agent transfers, measured in one run.

No model and no vLLM. NIXL paths run two agents in two spawned processes, as a prefill and a decode engine do,
and move the bytes as many block-sized descriptors with scattered block ids (so NIXL cannot merge them), then
check every byte that arrived. Imports only numpy at module level, so it runs as a plain script on a bare GPU
machine (`python3 -m pdserve.verify.microbench --help`); torch and nixl load only for the paths that need them.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from pdserve.verify.transfers import (
    NIXL_KINDS,
    POISON,
    SEED,
    WORD_BYTES,
    Operation,
    Path,
    PathKind,
    Plan,
    TransferResult,
    expected_blocks,
    pattern_torch,
)

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
    if block_bytes <= 0 or block_bytes % WORD_BYTES or size_bytes % block_bytes:
        raise ValueError(f"size_bytes={size_bytes} must be a multiple of block_bytes={block_bytes}, itself of 8")
    plan = Plan(size_bytes=size_bytes, block_bytes=block_bytes, repeats=max(repeats, 1), timeout_s=timeout_s)
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


def _with_limit(result: TransferResult, gbps_of: dict[PathKind, float]) -> TransferResult:
    limit_kind = LIMIT_OF[result.path.kind]
    return result if limit_kind is None else replace(result, limit_gbps=gbps_of.get(limit_kind))


def _measure_host_memcpy(path: Path, plan: Plan) -> TransferResult:
    src = np.arange(plan.n_words, dtype=np.int64) + SEED
    dst = np.full(plan.n_words, POISON, dtype=np.int64)
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


def _measure_cuda_local(path: Path, plan: Plan) -> TransferResult:
    import torch

    on_device = {PathKind.DEVICE_COPY: ("cuda", "cuda"), PathKind.PINNED_H2D: ("cpu", "cuda")}
    src_device, dst_device = on_device.get(path.kind, ("cuda", "cpu"))
    src = pattern_torch(torch, plan.n_words, src_device)
    dst = torch.full((plan.n_words,), POISON, dtype=torch.int64, device=dst_device, pin_memory=dst_device == "cpu")
    seconds = _time_cuda(torch, plan.repeats, lambda: dst.copy_(src, non_blocking=True))
    return TransferResult(path, plan.size_bytes, seconds, 1, bool(torch.equal(dst.cpu(), src.cpu())))


def _share_cuda_pattern(queue: Any, finished: Any, n_words: int) -> None:
    import torch
    import torch.multiprocessing  # registers the reductions that send CUDA tensors as IPC handles

    pattern = pattern_torch(torch, n_words, "cuda")  # held until the consumer is done with its mapping
    queue.put(pattern)
    finished.wait()


def _measure_cuda_ipc(path: Path, plan: Plan) -> TransferResult:
    import torch
    import torch.multiprocessing as tmp

    ctx = tmp.get_context("spawn")
    queue, finished = ctx.Queue(), ctx.Event()
    producer = ctx.Process(target=_share_cuda_pattern, args=(queue, finished, plan.n_words), daemon=True)
    producer.start()
    try:
        shared = queue.get(timeout=plan.timeout_s)
        dst = torch.full((plan.n_words,), POISON, dtype=torch.int64, device="cuda")
        if path.kind is PathKind.CUDA_IPC:
            seconds = _time_cuda(torch, plan.repeats, lambda: dst.copy_(shared))
            return TransferResult(path, plan.size_bytes, seconds, 1, bool(torch.equal(dst, shared)))
        perm = torch.from_numpy(plan.permutation()).cuda()
        src_blocks, dst_blocks = shared.view(plan.n_blocks, -1), dst.view(plan.n_blocks, -1)
        seconds = _time_cuda(torch, plan.repeats, lambda: torch.index_select(src_blocks, 0, perm, out=dst_blocks))
        expected = torch.from_numpy(expected_blocks(plan)).cuda()
        return TransferResult(path, plan.size_bytes, seconds, plan.n_blocks, bool(torch.equal(dst_blocks, expected)))
    finally:
        finished.set()
        producer.join(timeout=10)


def _measure_nixl_pair(path: Path, plan: Plan) -> TransferResult:
    from pdserve.verify.nixl_pair import measure_nixl  # loads nixl only for the paths that need it

    return measure_nixl(path, plan)


_MEASURE: dict[PathKind, Callable[[Path, Plan], TransferResult]] = {
    PathKind.HOST_MEMCPY: _measure_host_memcpy,
    PathKind.NIXL_DRAM: _measure_nixl_pair,
    PathKind.DEVICE_COPY: _measure_cuda_local,
    PathKind.PINNED_H2D: _measure_cuda_local,
    PathKind.PINNED_D2H: _measure_cuda_local,
    PathKind.CUDA_IPC: _measure_cuda_ipc,
    PathKind.CUDA_IPC_GATHER: _measure_cuda_ipc,
    PathKind.NIXL_VRAM: _measure_nixl_pair,
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
    block_bytes = int(args.block_kb * 1024) // WORD_BYTES * WORD_BYTES
    size_bytes = max(int(args.size_mb * 1e6) // block_bytes, 1) * block_bytes
    paths = [parse_path(text) for text in args.path] or default_paths(has_cuda=_has_cuda())
    results = run_microbench(
        size_bytes=size_bytes, block_bytes=block_bytes, paths=paths, repeats=args.repeats, timeout_s=args.timeout_s
    )
    print(format_table(results), flush=True)
    return 0 if all(r.is_verified for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())

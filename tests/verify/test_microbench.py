"""The raw-transfer microbenchmark on this machine's CPU: sane bandwidths, and NIXL moved exactly the right bytes."""

from __future__ import annotations

import math

import pytest

from pdserve.verify.microbench import LIMIT_OF, default_paths, format_table, parse_path, run_microbench
from pdserve.verify.transfers import Operation, Path, PathKind, TransferResult

SIZE_BYTES = 4 * 1024 * 1024
BLOCK_BYTES = 16 * 1024


def test_parse_path_reads_operation_backend_threads_and_env() -> None:
    path = parse_path("nixl-vram op=write backend=UCX threads=2 UCX_TLS=cuda_ipc,cuda_copy,tcp UCX_X=y")

    assert path == Path(
        kind=PathKind.NIXL_VRAM,
        operation=Operation.WRITE,
        num_threads=2,
        env=(("UCX_TLS", "cuda_ipc,cuda_copy,tcp"), ("UCX_X", "y")),
    )
    assert path.label == "nixl-vram WRITE UCX threads=2 UCX_TLS=cuda_ipc,cuda_copy,tcp UCX_X=y"


def test_parse_path_rejects_options_on_a_hardware_path() -> None:
    with pytest.raises(ValueError, match="NIXL paths only"):
        parse_path("host-memcpy UCX_TLS=tcp")


def test_every_transfer_path_is_bounded_by_a_measured_hardware_path() -> None:
    for kind, limit in LIMIT_OF.items():
        assert limit is None or LIMIT_OF[limit] is None, kind


def test_default_paths_without_cuda_are_host_only() -> None:
    assert [p.kind for p in default_paths(has_cuda=False)] == [PathKind.HOST_MEMCPY, PathKind.NIXL_DRAM]


def test_run_microbench_rejects_a_size_that_is_not_whole_blocks() -> None:
    with pytest.raises(ValueError, match="multiple of block_bytes"):
        run_microbench(size_bytes=BLOCK_BYTES + 8, block_bytes=BLOCK_BYTES, paths=[Path(PathKind.HOST_MEMCPY)])


def test_nixl_dram_read_and_write_move_the_right_bytes_at_a_sane_rate() -> None:
    paths = [Path(PathKind.NIXL_DRAM), Path(PathKind.NIXL_DRAM, operation=Operation.WRITE, num_threads=0)]

    results = run_microbench(size_bytes=SIZE_BYTES, block_bytes=BLOCK_BYTES, paths=paths, repeats=2, timeout_s=60)

    memcpy, *nixl = results
    assert memcpy.path.kind is PathKind.HOST_MEMCPY  # the limit is measured in the same run, first
    assert memcpy.is_verified and memcpy.gbps > 0.1
    for result in nixl:
        assert result.error is None
        assert result.is_verified  # every word of the destination checked against the scattered source blocks
        assert result.descriptors == SIZE_BYTES // BLOCK_BYTES
        assert 0.001 < result.gbps and result.limit_gbps == memcpy.gbps
        assert result.ratio is not None and 0 < result.ratio < 5


def test_format_table_shows_ratio_and_failures() -> None:
    ok = TransferResult(Path(PathKind.NIXL_DRAM), 2_000_000, 0.001, 10, True, limit_gbps=4.0)
    failed = TransferResult(Path(PathKind.NIXL_VRAM), 2_000_000, math.inf, 10, False, error="TimeoutError: slow")

    table = format_table([ok, failed])

    assert "2.00" in table and "0.500" in table
    assert "ERR TimeoutError: slow" in table

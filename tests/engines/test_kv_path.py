from __future__ import annotations

from pathlib import Path

from pdserve.engines.kv_path import KvPath, KvPathLog, kv_path_from_log

UCX_LOG = """2026 NIXL INFO _api.py:405 Backend UCX was instantiated
[17.7] [vm:1:0]   | remote memory write by ucp_put* from host memory to host |
[17.7] [vm:1:0]   | 0..inf | zero-copy   | tcp/lo                                |
[17.7] [vm:1:0]   | remote memory read by ucp_get*(multi) into host memory from host |
[17.7] [vm:1:0]   +--------+-------------+-------------------------------------------+
[17.7] [vm:1:0]   | Range  | Description |                  Config                   |
[17.7] [vm:1:0]   | 0..inf | zero-copy   | cma/memory                                |
[17.7] [vm:1:0]   | active message by ucp_am_send* from host memory |
[17.7] [vm:1:0]   | 0..8k  | short       | tcp/lo                                |
"""
LIBFABRIC_LOG = """=== pdserve: starting decode-0: py -m vllm.entrypoints.openai.api_server
=== pdserve: kv buffer cpu: EFA without GPUDirect RDMA (no peermem module loaded)
=== pdserve: libfabric provider efa: placement.efa_devices=1
2026 NIXL INFO _api.py:405 Backend LIBFABRIC was instantiated
"""


def test_backends_and_read_transports_come_from_engine_logs() -> None:
    assert kv_path_from_log(UCX_LOG) == KvPath(backends=("UCX",), transports=("cma/memory (zero-copy)",))


# NIXL's INFO line once its rails exist (nixl src/utils/libfabric/libfabric_rail_manager.cpp), in Abseil's
# log prefix as NIXL prints it (see tests/engines/test_nixl_plugins.py for a captured line)
OPENED_EFA = "I1203 10:00:02.512310     812 libfabric_rail_manager.cpp:232] Created 1 rails using provider=efa\n"


def test_libfabric_provider_is_the_one_nixl_says_it_opened_and_the_buffer_pdserves_note() -> None:
    path = kv_path_from_log(LIBFABRIC_LOG + OPENED_EFA)
    assert (path.backends, path.provider, path.buffer_device) == (("LIBFABRIC",), "efa", "cpu")
    assert path.buffer_reason == "EFA without GPUDirect RDMA (no peermem module loaded)"
    # NIXL 1.0 logged the same at DEBUG, worded differently
    opened = LIBFABRIC_LOG + "I1130 libfabric_rail_manager.cpp:233] Successfully created 1 rails using provider=tcp\n"
    assert kv_path_from_log(opened).provider == "tcp"
    # A backend that never came up has no provider, whatever was asked.
    assert kv_path_from_log((LIBFABRIC_LOG + OPENED_EFA).replace("LIBFABRIC was", "UCX was")).provider == ""


def test_the_fi_provider_pdserve_set_is_not_reported_as_the_provider_opened() -> None:
    """pdserve's note says what it asked libfabric for; without NIXL's own line nothing was observed."""
    assert kv_path_from_log(LIBFABRIC_LOG).provider == ""


def test_the_last_start_in_a_log_tells_where_the_buffer_is() -> None:
    restarted = LIBFABRIC_LOG + "=== pdserve: kv buffer cuda: set by kv.buffer_device\n"
    assert kv_path_from_log(restarted).buffer_device == "cuda"


def test_kv_path_log_reads_only_new_complete_lines(tmp_path: Path) -> None:
    path = tmp_path / "engine.log"
    reader = KvPathLog(path)
    assert reader.read() == KvPath()  # no log yet
    path.write_text("starting\n" + UCX_LOG[:10])  # a line still being written
    assert reader.read() == KvPath()
    with path.open("a") as log:
        log.write(UCX_LOG[10:] + "GET /health 200\n" * 3)
    expected = KvPath(backends=("UCX",), transports=("cma/memory (zero-copy)",))
    assert reader.read() == expected
    assert reader.read() == expected  # kept, not re-read

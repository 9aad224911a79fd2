from __future__ import annotations

import sys

from pdserve.engines.nixl_plugins import backend_problems, load_problems

# NIXL 1.5.1 at NIXL_LOG_LEVEL=DEBUG on a host with Debian's libfabric1 1.17 and no NVIDIA driver.
OUTPUT = """I1130 15:50:13.947688   20197 nixl_plugin_manager.cpp:623] Discovered backend plugin: LIBFABRIC
I1130 15:50:13.949065   20197 nixl_plugin_manager.cpp:352] Failed to load plugin from /v/.nixl_cu13.mesonpy.libs/plugins/libplugin_LIBFABRIC.so: libcuda.so.1: cannot open shared object file: No such file or directory
E1130 15:50:13.949100   20197 nixl_agent.cpp:334] createBackend: unsupported backend 'LIBFABRIC'
pdserve: backend LIBFABRIC not created: NIXL_ERR_NOT_FOUND
"""


def test_a_backend_that_cannot_load_is_named_with_the_library_nixl_could_not_open() -> None:
    assert load_problems(OUTPUT) == {"LIBFABRIC": "libcuda.so.1: cannot open shared object file: No such file or directory"}
    assert load_problems("pdserve: backend GDS not created: NIXL_ERR_BACKEND\n") == {"GDS": "NIXL_ERR_BACKEND"}
    assert load_problems(OUTPUT.replace("pdserve: backend LIBFABRIC not created", "created")) == {}


async def test_ucx_is_created_by_this_hosts_nixl() -> None:
    assert await backend_problems(["UCX"], python=sys.executable, env={}) == {}

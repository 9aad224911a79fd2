"""One request through a given prefill/decode pair, straight to the two engines (no routing, no gateway):
the gateway's warm-up of each pair and ``pdserve verify``'s probes. I/O only; raises LegFailed as the legs do.
"""

from __future__ import annotations

import time
from typing import Any

from pdserve.pd import decode, prefill
from pdserve.pd.engine_http import EngineClient

COMPLETIONS = "/v1/completions"


async def send_through_pair(
    client: EngineClient, *, prefill_url: str, decode_url: str, body: dict[str, Any], connector: str, request_id: str,
    timeout_s: float,
) -> tuple[float, float]:
    """Prefill ``body`` (a completions request) on one engine, decode it on the other, read the reply whole.
    Returns (prefill seconds, decode seconds: the KV pull and the decode steps)."""
    started_s = time.perf_counter()
    kv = await prefill.run(client, prefill_url + COMPLETIONS, prefill.make_body(body, connector=connector),
                           request_id=request_id, timeout_s=timeout_s)
    prefill_done_s = time.perf_counter()
    response = await decode.open_stream(client, decode_url + COMPLETIONS, decode.make_body(body, kv),
                                        request_id=request_id, timeout_s=timeout_s)
    try:
        await response.read(idle_timeout_s=timeout_s)
    finally:
        response.close()
    return prefill_done_s - started_s, time.perf_counter() - prefill_done_s

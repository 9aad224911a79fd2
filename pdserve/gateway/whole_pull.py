"""A whole (non-streamed) PD reply whose KV pull hangs (a link cut between the engines mid-pull).

Its headers come with its last token, so waiting cannot tell a hung pull from a long reply, as a
stream's first token does (relay.py). The decode engine's own count of pulls pending can
(routing/load.py, read every routing.load_scrape_interval_s): past ``kv_pull_timeout_s`` with a
pull pending there, the request is also sent with no handoff, which the decode engine prefills
itself, and the first whole reply wins; the other leg is closed (vLLM aborts it). With none
pending, the pull is over and the reply is only long: it is waited for. An engine that does not
count its pulls (vLLM before 0.32) says none, so its replies wait for ``request_timeout_s``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable

from pdserve.errors import PdserveError
from pdserve.gateway.decode_leg import DecodeLeg


async def first_whole(handoff: asyncio.Task[DecodeLeg], *, pull_timeout_s: float, is_pull_pending: Callable[[], bool],
                      local: Callable[[], Awaitable[DecodeLeg]]) -> tuple[DecodeLeg, bool]:
    """The decode leg whose whole reply came first, and True where it is ``local``'s (the pull was
    taken for lost). Raises the handoff leg's error where no leg answers. Cancelled (the client
    left), both legs are."""
    fallback: asyncio.Future[DecodeLeg] | None = None
    winner: asyncio.Future[DecodeLeg] | None = None
    try:
        answered, _ = await asyncio.wait({handoff}, timeout=pull_timeout_s)
        if answered or not is_pull_pending():
            winner = handoff
            return await handoff, False
        fallback = asyncio.ensure_future(local())
        pending: set[asyncio.Future[DecodeLeg]] = {handoff, fallback}
        while pending and winner is None:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            winner = next((leg for leg in (handoff, fallback) if leg in done and leg.exception() is None), None)
        if winner is None:
            return await handoff, False  # raises its error: it says more than the local leg's
        return winner.result(), winner is fallback
    finally:
        for leg in (handoff, fallback):
            if leg is not None and leg is not winner:
                await _drop(leg)


async def _drop(leg: asyncio.Future[DecodeLeg]) -> None:
    """A leg that lost: cancelled (its engine aborts the request), or closed had it opened meanwhile."""
    leg.cancel()
    with contextlib.suppress(asyncio.CancelledError, PdserveError):
        (await leg).close()

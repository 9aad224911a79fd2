"""DisconnectGuard: a client disconnect cancels the guarded work; other cancellations pass through."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from pdserve.gateway.disconnect import ClientDisconnected, DisconnectGuard


def receiving(messages: asyncio.Queue[dict[str, Any]]) -> Any:
    async def receive() -> dict[str, Any]:
        return await messages.get()

    return receive


async def test_disconnect_cancels_the_work_and_raises_client_disconnected() -> None:
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
    work_cancelled = asyncio.Event()

    async def serve() -> None:
        with DisconnectGuard(receiving(messages)):
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                work_cancelled.set()
                raise

    task = asyncio.ensure_future(serve())
    await asyncio.sleep(0)
    await messages.put({"type": "http.disconnect"})
    with pytest.raises(ClientDisconnected):
        await task
    assert work_cancelled.is_set() and task.cancelling() == 0


async def test_work_that_finishes_is_untouched_and_the_watcher_stops() -> None:
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def serve() -> str:
        with DisconnectGuard(receiving(messages)):
            await asyncio.sleep(0.01)
            return "done"

    assert await serve() == "done"
    await messages.put({"type": "http.disconnect"})  # too late to matter
    await asyncio.sleep(0.01)


async def test_a_shutdown_cancellation_is_not_mistaken_for_a_disconnect() -> None:
    messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()

    async def serve() -> None:
        with DisconnectGuard(receiving(messages)):
            await asyncio.sleep(10)

    task = asyncio.ensure_future(serve())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

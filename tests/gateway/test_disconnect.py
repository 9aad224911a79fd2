"""DisconnectGuard: a client disconnect cancels the guarded work; other cancellations pass through.
Each test runs with the server's ``lost`` future (gateway/server.py) and with the watcher task that
reads ``receive`` where a server offers none."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest

from pdserve.gateway.disconnect import ClientDisconnected, DisconnectGuard


class Client:
    """One client connection as the guard sees it, told apart by how it says it left."""

    def __init__(self, *, offers_lost: bool) -> None:
        self._messages: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._lost: asyncio.Future[None] | None = asyncio.get_running_loop().create_future() if offers_lost else None

    def guard(self) -> DisconnectGuard:
        return DisconnectGuard(self._receive, lost=self._lost)

    def leave(self) -> None:
        if self._lost is not None:
            self._lost.set_result(None)
        else:
            self._messages.put_nowait({"type": "http.disconnect"})

    async def _receive(self) -> dict[str, Any]:
        if self._lost is not None:
            raise AssertionError("receive is not read where the server says when the connection is lost")
        return await self._messages.get()


@pytest.fixture(params=[True, False], ids=["lost-future", "watcher-task"])
def client(request: pytest.FixtureRequest) -> Callable[[], Client]:
    return lambda: Client(offers_lost=request.param)


async def test_disconnect_cancels_the_work_and_raises_client_disconnected(client: Callable[[], Client]) -> None:
    connection = client()
    work_cancelled = asyncio.Event()

    async def serve() -> None:
        with connection.guard():
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                work_cancelled.set()
                raise

    task = asyncio.ensure_future(serve())
    await asyncio.sleep(0)
    connection.leave()
    with pytest.raises(ClientDisconnected):
        await task
    assert work_cancelled.is_set() and task.cancelling() == 0


async def test_work_that_finishes_is_untouched_and_a_later_disconnect_cancels_nothing(
        client: Callable[[], Client]) -> None:
    connection = client()

    async def serve() -> str:
        with connection.guard():
            await asyncio.sleep(0.01)
            connection.leave()  # as the block ends: what it sets off comes too late to matter
        await asyncio.sleep(0.01)
        return "done"

    assert await serve() == "done"


async def test_a_shutdown_cancellation_is_not_mistaken_for_a_disconnect(client: Callable[[], Client]) -> None:
    connection = client()

    async def serve() -> None:
        with connection.guard():
            await asyncio.sleep(10)

    task = asyncio.ensure_future(serve())
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

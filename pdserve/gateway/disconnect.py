"""Stop serving a request the moment its client disconnects: cancel the very task doing the work.

The work stays in the request's own task rather than in a child task raced against a watcher:
that saves the event-loop hops of starting and joining the child, which under load are a large
part of the time the gateway adds. Where the server says when the connection is lost (a future,
gateway/server.py), a callback on it cancels the work; elsewhere a small watcher task reads
``receive`` until ``http.disconnect``.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Any

from starlette.types import Receive


class ClientDisconnected(Exception):
    """The client went away; whatever the guarded block was doing was cancelled."""


class DisconnectGuard:
    """``with DisconnectGuard(receive): ...`` cancels the block's task if the client disconnects;
    the block then raises ClientDisconnected instead of CancelledError. Any other cancellation
    (server shutdown) passes through untouched, as with ``asyncio.timeout``.

    ``receive`` must have nothing left to deliver but ``http.disconnect`` (read the body first);
    ``lost``, where given, is done once the client's connection is lost, and ``receive`` is not read.
    """

    def __init__(self, receive: Receive, *, lost: asyncio.Future[None] | None = None) -> None:
        task = asyncio.current_task()
        assert task is not None, "DisconnectGuard needs a running task"
        self._task, self._receive, self._lost = task, receive, lost
        self._cancelling = task.cancelling()
        self._is_guarding = self._is_disconnected = False
        self._watcher: asyncio.Task[None] | None = None

    def __enter__(self) -> None:
        self._is_guarding = True
        if self._lost is not None:
            self._lost.add_done_callback(self._on_lost)
        else:
            self._watcher = asyncio.ensure_future(self._watch())

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._is_guarding = False
        if self._lost is not None:
            self._lost.remove_done_callback(self._on_lost)
        elif self._watcher is not None:
            self._watcher.cancel()
        was_ours = self._is_disconnected and exc_type is not None and issubclass(exc_type, asyncio.CancelledError)
        if was_ours and self._task.uncancel() <= self._cancelling:
            raise ClientDisconnected() from exc

    async def _watch(self) -> None:
        message: Any = await self._receive()
        while message["type"] != "http.disconnect":
            message = await self._receive()
        self._cancel()

    def _on_lost(self, _lost: asyncio.Future[None]) -> None:
        if self._is_guarding:  # a callback already scheduled as the block ended: the work is done
            self._cancel()

    def _cancel(self) -> None:
        self._is_disconnected = True
        self._task.cancel()

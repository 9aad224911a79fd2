"""Types of the C module _chunk_relay.c (what native_relay.py calls)."""

from collections.abc import Sequence

END: int
HANDBACK: int
ENGINE_LOST: int
CLIENT_BLOCKED: int
IDLE: int
CANCELLED: int
THREAD_NAME: str

class Relay:
    def __init__(self, wake_fd: int, bounds_s: Sequence[float]) -> None: ...
    def submit(self, *, stream_id: int, engine_fd: int, client_fd: int, previous_s: float, deadline_s: float,
               idle_timeout_s: float, watch_usage: bool) -> None: ...
    def cancel(self, stream_id: int, /) -> None: ...
    def take_finished(
        self,
    ) -> list[tuple[int, int, bytes, bytes, bytes, int, tuple[int, ...], float, float, float]]: ...
    def close(self) -> None: ...

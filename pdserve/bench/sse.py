"""Read an OpenAI-style SSE stream as the load generator needs it: which events carry a token,
the usage count, an error event. Pure; no I/O, no clocks (the runner stamps arrival times).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

_EVENT_END = b"\n\n"
_DATA = b"data:"
DONE = b"[DONE]"  # the data of the last event


@dataclass(frozen=True, slots=True)
class Event:
    carries_token: bool
    completion_tokens: int | None = None  # from a usage object, when the event has one
    error: str | None = None


class EventSplitter:
    """Cuts a byte stream into complete events' data payloads; keeps a partial event for later."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        """The data payloads of every event completed by ``chunk`` (``[DONE]`` included)."""
        *complete, self._pending = (self._pending + chunk).replace(b"\r\n", b"\n").split(_EVENT_END)
        payloads = []
        for event in complete:
            for line in event.split(b"\n"):
                if line.startswith(_DATA):
                    payloads.append(line[len(_DATA):].strip())
        return payloads


class StreamReading:
    """What one response's SSE stream told a client so far: when each token event arrived, the
    usage count, an error event, whether ``[DONE]`` came."""

    def __init__(self) -> None:
        self.token_times_s: list[float] = []
        self.usage_tokens: int | None = None
        self.error: str | None = None
        self._splitter = EventSplitter()
        self._saw_done = False

    def feed(self, chunk: bytes, *, now_s: float) -> None:
        """``chunk`` of the body, which arrived at ``now_s`` (the caller's clock)."""
        for data in self._splitter.feed(chunk):
            if data == DONE:
                self._saw_done = True
                continue
            event = classify(data)
            if event.carries_token:
                self.token_times_s.append(now_s)
            self.usage_tokens = event.completion_tokens or self.usage_tokens
            self.error = event.error or self.error

    def outcome(self) -> str | None:
        """The error to record, None for a complete stream."""
        if self.error is None and not self._saw_done:
            return "stream ended without [DONE]"
        return self.error


def classify(payload: bytes) -> Event:
    """What one event's data means. A token is a choice with text (completions) or a delta
    with content (chat); the chat role announcement and a bare finish marker are not tokens.
    """
    if payload == DONE:
        return Event(carries_token=False)
    try:
        data = json.loads(payload)
    except ValueError:
        return Event(carries_token=False, error=f"unparseable event: {payload[:100]!r}")
    if not isinstance(data, dict):
        return Event(carries_token=False, error=f"unexpected event: {payload[:100]!r}")
    if isinstance(data.get("error"), dict):
        return Event(carries_token=False, error=str(data["error"].get("message")))
    usage = data.get("usage")
    completion_tokens = usage.get("completion_tokens") if isinstance(usage, dict) else None
    choices = data.get("choices") or []
    return Event(carries_token=bool(choices) and _is_token(choices[0]), completion_tokens=completion_tokens)


def _is_token(choice: dict[str, Any]) -> bool:
    if "text" in choice:
        return bool(choice["text"]) or choice.get("finish_reason") is None
    delta = choice.get("delta") or {}
    return bool(delta) and "role" not in delta

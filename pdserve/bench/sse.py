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

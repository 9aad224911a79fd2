"""What to send and when: request bodies (synthetic, shared-prefix chat, trace replay) and arrival times.

Pure apart from reading a trace file; seeded, so every target of a run gets requests of the
same lengths at the same moments. The prompt text also depends on a ``salt`` (one per target and
load level), so no engine's prefix cache can answer one target's prefills from another's run. Output lengths are exact: ``ignore_eos`` with ``max_tokens``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pdserve.bench.prompts import PromptMaker
from pdserve.errors import ConfigError

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


@dataclass(frozen=True, slots=True)
class Lengths:
    """A token count: fixed (``low == high``) or uniform over [low, high]. Parsed from "128" or "64-256"."""

    low: int
    high: int

    @classmethod
    def parse(cls, text: str, *, name: str) -> Lengths:
        low_text, _, high_text = text.partition("-")
        try:
            low, high = int(low_text), int(high_text or low_text)
        except ValueError:
            raise ConfigError(f"{name}: expected N or LOW-HIGH tokens, not {text!r}") from None
        if not 1 <= low <= high:
            raise ConfigError(f"{name}: need 1 <= LOW <= HIGH, not {text!r}")
        return cls(low, high)

    def sample(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    path: str  # COMPLETIONS or CHAT
    body: dict[str, Any]  # streamed, with usage, exact output length
    at_s: float | None = None  # arrival offset from the start of the run, when the trace fixes it


def _streamed(body: dict[str, Any], *, output_tokens: int) -> dict[str, Any]:
    return body | {
        "max_tokens": output_tokens, "ignore_eos": True, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True},
    }


def synthetic(
    count: int, *, model: str, input_tokens: Lengths, output_tokens: Lengths, prompts: PromptMaker, seed: int,
    salt: int = 0,
) -> list[BenchRequest]:
    """``count`` completions with random prompts; lengths drawn per request."""
    lengths, text = _rngs(seed, salt)
    return [
        BenchRequest(COMPLETIONS, _streamed(
            {"model": model, "prompt": prompts.make(input_tokens.sample(lengths), rng=text)},
            output_tokens=output_tokens.sample(lengths),
        ))
        for _ in range(count)
    ]


def shared_prefix_chat(
    count: int, *, model: str, prefix_tokens: int, turn_tokens: Lengths, output_tokens: Lengths, turns: int,
    prompts: PromptMaker, seed: int, salt: int = 0,
) -> list[BenchRequest]:
    """Multi-turn conversations that all share one system prompt of ``prefix_tokens``.

    Turn k of a conversation repeats its k-1 earlier exchanges (the assistant's replies are
    stand-ins of the right length), so later turns share ever longer prefixes. Requests are
    ordered turn by turn across conversations so each conversation's turns arrive in order.
    """
    lengths, text = _rngs(seed, salt)
    system = {"role": "system", "content": prompts.make(prefix_tokens, rng=text)}
    conversations = max(1, -(-count // turns))
    histories: list[list[dict[str, str]]] = [[system] for _ in range(conversations)]
    requests: list[BenchRequest] = []
    for _turn in range(turns):
        for history in histories:
            if len(requests) == count:
                return requests
            history.append({"role": "user", "content": prompts.make(turn_tokens.sample(lengths), rng=text)})
            reply_tokens = output_tokens.sample(lengths)
            body = {"model": model, "messages": list(history)}
            requests.append(BenchRequest(CHAT, _streamed(body, output_tokens=reply_tokens)))
            history.append({"role": "assistant", "content": prompts.make(reply_tokens, rng=text)})
    return requests


def _rngs(seed: int, salt: int) -> tuple[random.Random, random.Random]:
    """One generator for lengths (the same for every salt) and one for the text (per salt)."""
    return random.Random(seed), random.Random(f"{seed}:{salt}")


def replay_trace(path: Path, *, model: str, prompts: PromptMaker, seed: int) -> list[BenchRequest]:
    """Requests from a JSONL trace, one object per line.

    Fields: ``output_tokens`` (required); ``prompt`` (text), ``messages`` (chat) or
    ``input_tokens`` (synthesised prompt); optional ``timestamp`` (seconds from the start).
    Raises ConfigError naming the line of a malformed entry.
    """
    rng = random.Random(seed)
    requests = []
    for number, line in _trace_lines(path):
        try:
            entry = json.loads(line)
            output_tokens = int(entry["output_tokens"])
            at_s = float(entry["timestamp"]) if "timestamp" in entry else None
            if "messages" in entry:
                path_, body = CHAT, {"model": model, "messages": entry["messages"]}
            else:
                prompt = entry.get("prompt") or prompts.make(int(entry["input_tokens"]), rng=rng)
                path_, body = COMPLETIONS, {"model": model, "prompt": prompt}
        except (ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"{path}:{number}: bad trace entry ({exc!r})") from exc
        requests.append(BenchRequest(path_, _streamed(body, output_tokens=output_tokens), at_s=at_s))
    return requests


def _trace_lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"cannot read trace {path}: {exc.strerror}") from exc
    for number, line in enumerate(text.splitlines(), start=1):
        if line.strip():
            yield number, line


def poisson_arrivals(count: int, *, rate: float, seed: int) -> list[float]:
    """Offsets (s) of ``count`` arrivals of a Poisson process at ``rate`` requests/s; first at 0."""
    rng = random.Random(seed)
    offsets, now_s = [], 0.0
    for _ in range(count):
        offsets.append(now_s)
        now_s += rng.expovariate(rate)
    return offsets

"""Estimate how much of a prompt each engine already holds in its prefix cache, without tokenizing.

The prompt is cut into fixed-size character chunks hashed in a chain, as vLLM chains its KV block
hashes: a chunk's hash stands for the whole prompt up to its end. Per engine, a bounded LRU set
remembers the chunk hashes of the prompts routed there, sized like the engine's cache, so the
longest run of leading hashes found there is the expected cached prefix.

That index is one gateway process's own. What every process and replica agrees on without sharing
anything is the prompt's *home*: a digest of the conversation's opening, the same for each of its
turns, ranks the engines (rendezvous hashing, ``home_rank``). No I/O.
"""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class PromptKey:
    """One request's prompt as routing sees it: chained chunk hashes and a token estimate."""

    hashes: tuple[int, ...]  # one per full chunk, each standing for the prompt up to its end
    chunk_chars: int
    chars: int  # of the canonical prompt text
    tokens: float  # estimated prompt tokens
    home: bytes = b""  # digest of the conversation's opening: equal for each of its turns, in every process
    home_tokens: float = 0.0  # of the prompt, those its home holds if the conversation's earlier turns went there

    def matched_tokens(self, matched_chunks: int) -> float:
        """Estimated tokens in the first ``matched_chunks`` chunks, at most the whole prompt."""
        if self.chars == 0:
            return 0.0
        return min(self.tokens, matched_chunks * self.chunk_chars * self.tokens / self.chars)


def prompt_key(body: Mapping[str, Any], *, chunk_chars: int, chars_per_token: float,
               home_key_chars: int) -> PromptKey:
    """The key of a validated completions or chat request body (``prompt`` or ``messages``).

    Tokens are estimated at ``chars_per_token``, except for a prompt given as token ids.
    """
    prompt = body.get("prompt")
    if "messages" in body:
        pieces = _chat_pieces(body)
        text = "".join(pieces)
        # It opens with its tools and messages up to the first user message; its earlier turns sent all but the last.
        first_user = next((index for index, message in enumerate(body["messages"], 1) if message.get("role") == "user"),
                          len(pieces) - 1)
        opening, history_chars = "".join(pieces[:first_user + 1]), len(text) - len(pieces[-1])
    else:  # no turns to tell apart: its first home_key_chars characters open it, all it is known to have sent
        text = prompt_text(body)
        opening, history_chars = text[:home_key_chars], min(len(text), home_key_chars)
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], int):
        tokens = float(len(prompt))
    else:
        tokens = len(text) / chars_per_token
    return PromptKey(hashes=chunk_hashes(text, chunk_chars=chunk_chars), chunk_chars=chunk_chars,
                     chars=len(text), tokens=tokens, home=hashlib.blake2b(opening.encode(), digest_size=8).digest(),
                     home_tokens=tokens * history_chars / len(text) if text else 0.0)


def home_rank(home: bytes, url: str) -> int:
    """The engine's rank for prompts of this home (rendezvous hashing): the highest ranked
    candidate is the home, and if it leaves, each of its prompts moves to its own next, so the
    other engines keep theirs. A stable digest, unlike Python's hash: every process agrees."""
    return int.from_bytes(hashlib.blake2b(home + url.encode(), digest_size=8).digest(), "big")


def prompt_text(body: Mapping[str, Any]) -> str:
    """A canonical text of the prompt: equal for equal prompts, and a conversation's next turn
    starts with the text of the turns before it, as its chat template's rendering would."""
    if "messages" in body:
        return "".join(_chat_pieces(body))
    prompt = body.get("prompt", "")
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], str):
        return str(prompt[0])  # a list of one string (protocol.py allows no more)
    return "".join(f"{token_id}," for token_id in prompt)  # token ids: equal leading ids, equal leading text


def _chat_pieces(body: Mapping[str, Any]) -> list[str]:
    """A chat's canonical text in pieces: its tools (empty without), then each message."""
    tools = body.get("tools")
    return [f"<tools>{json.dumps(tools, sort_keys=True)}</tools>\n" if tools else "",
            *(_message_text(message) for message in body["messages"])]


def _message_text(message: Mapping[str, Any]) -> str:
    content = message.get("content")
    if isinstance(content, list):  # content parts: text as is, anything else by its JSON
        content = "".join(part["text"] if part.get("type") == "text" and isinstance(part.get("text"), str)
                          else json.dumps(part, sort_keys=True) for part in content)
    extra = {key: value for key, value in message.items() if key not in ("role", "content")}  # tool calls, names
    tail = json.dumps(extra, sort_keys=True) if extra else ""
    return f"<|{message.get('role')}|>{content or ''}{tail}<|end|>\n"


def chunk_hashes(text: str, *, chunk_chars: int) -> tuple[int, ...]:
    """Chained hashes of ``text``'s full ``chunk_chars`` chunks; a partial tail is left out, as
    vLLM caches only full blocks. Python's str hash: stable within one gateway process, which
    is as far as its index reaches."""
    hashes, previous = [], 0
    for start in range(0, len(text) - chunk_chars + 1, chunk_chars):
        previous = hash((previous, text[start:start + chunk_chars]))
        hashes.append(previous)
    return tuple(hashes)


class PrefixIndex:
    """Per engine (by URL), the chunk hashes routed there, least recently used evicted first.

    An engine evicts cached blocks least recently used first too, so an index sized like the
    engine's cache forgets roughly what the engine forgets.
    """

    def __init__(self, *, default_capacity_chunks: int) -> None:
        self._default_capacity_chunks = default_capacity_chunks
        self._chunks: dict[str, OrderedDict[int, None]] = {}
        self._capacity_chunks: dict[str, int] = {}

    def matched_chunks(self, url: str, hashes: Sequence[int]) -> int:
        """How many of ``hashes``, from the first, the engine at ``url`` is expected to hold."""
        known = self._chunks.get(url)
        if not known:
            return 0
        for count, chunk_hash in enumerate(hashes):
            if chunk_hash not in known:
                return count
        return len(hashes)

    def insert(self, url: str, hashes: Sequence[int]) -> None:
        """Remember that a prompt with these chunk hashes was routed to ``url`` (just used).

        The first chunk becomes the most recently used: vLLM frees a finished request's blocks
        tail first, so a shared prefix outlives the tails that follow it.
        """
        known = self._chunks.setdefault(url, OrderedDict())
        for chunk_hash in reversed(hashes):
            known[chunk_hash] = None
            known.move_to_end(chunk_hash)
        self._evict(url)

    def resize(self, url: str, capacity_chunks: int) -> None:
        """Bound ``url``'s entries to ``capacity_chunks`` (from the engine's reported cache size)."""
        self._capacity_chunks[url] = max(1, capacity_chunks)
        self._evict(url)

    def forget(self, url: str) -> None:
        """Drop what is known of ``url``: the engine restarted with an empty cache, or left."""
        self._chunks.pop(url, None)
        self._capacity_chunks.pop(url, None)

    def size(self, url: str) -> int:
        return len(self._chunks.get(url, ()))

    def _evict(self, url: str) -> None:
        known = self._chunks.get(url)
        capacity = self._capacity_chunks.get(url, self._default_capacity_chunks)
        while known is not None and len(known) > capacity:
            known.popitem(last=False)

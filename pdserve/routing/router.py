"""Cache- and load-aware routing for the orchestrator: endpoints in, a choice and a decision out.

Holds what outlives one request (the prefix index) and turns each candidate ``Endpoint`` into the
``EngineView`` the pure cost and decision functions weigh, ranked for the prompt's home.
Per request: ``key`` once, ``choose`` the decode engine, ``decide``, ``choose`` the prefill engine,
``record`` each leg sent, and hold ``prefilling`` around the prefill leg. No I/O.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from pdserve.gateway_config import RoutingSpec
from pdserve.role import Role
from pdserve.routing.cost import EngineView, choose_decode, choose_prefill
from pdserve.routing.decision import Decision, Mode, decide
from pdserve.routing.load import EngineLoad
from pdserve.routing.pool import Endpoint
from pdserve.routing.prefix import PrefixIndex, PromptKey, home_rank, prompt_key


class Router:
    """One per gateway process. ``gateway_processes``: how many share the engines (each index
    sees only its own process's requests, so it keeps that share of each engine's cache)."""

    def __init__(self, spec: RoutingSpec, *, gateway_processes: int = 1,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._spec, self._share, self._clock = spec, 1.0 / gateway_processes, clock
        self._index = PrefixIndex(default_capacity_chunks=self._capacity_chunks(spec.prefix_cache_tokens))
        self._queried_tokens: dict[str, float] = {}  # per engine, at its last read: a drop means a restart

    def key(self, body: Mapping[str, Any]) -> PromptKey:
        """Hash a validated request body once; every other call takes the key."""
        return prompt_key(body, chunk_chars=self._spec.prefix_chunk_chars, chars_per_token=self._spec.chars_per_token,
                          home_key_chars=self._spec.home_key_chars)

    def choose(self, key: PromptKey, candidates: Sequence[Endpoint]) -> Endpoint:
        """The cheapest of ``candidates`` (all of one role) for this prompt; the highest ranked of
        them is its home (prefix.py). Raises ValueError if empty."""
        if not candidates:
            raise ValueError("no engine to choose from")
        if len(candidates) == 1:  # nothing to weigh (one prefill engine is a common shape)
            return candidates[0]
        ranks = {endpoint.url: home_rank(key.home, endpoint.url) for endpoint in candidates}
        home = max(ranks, key=lambda url: ranks[url])
        is_decode = candidates[0].role is Role.DECODE
        views = [self.view(endpoint, key, rank=ranks[endpoint.url],
                           home_tokens=key.home_tokens if is_decode and endpoint.url == home else 0.0)
                 for endpoint in candidates]
        by_url = {endpoint.url: endpoint for endpoint in candidates}
        if is_decode:
            chosen = choose_decode(views, spec=self._spec)
        else:
            chosen = choose_prefill(views, prompt_tokens=key.tokens)
        return by_url[chosen.url]

    def decide(self, key: PromptKey, decode: Endpoint, *, prefill: Sequence[Endpoint],
               requested: Mode | None = None) -> Decision:
        """PD or local for this prompt on the chosen ``decode`` engine; ``prefill``: the healthy
        prefill engines; ``requested``: the client's X-PD-Mode header, if it sent one."""
        return decide(prompt_tokens=key.tokens, decode=self.view(decode, key),
                      prefill=[self.view(endpoint, key) for endpoint in prefill], spec=self._spec,
                      requested=requested)

    def record(self, key: PromptKey, endpoint: Endpoint) -> None:
        """A leg of this prompt went to ``endpoint``: it now holds the prompt's prefix."""
        self._index.insert(endpoint.url, key.hashes)

    @contextmanager
    def prefilling(self, key: PromptKey, endpoint: Endpoint) -> Iterator[None]:
        """Count this prompt's uncached tokens as queued on the prefill ``endpoint`` for the block."""
        tokens = self.view(endpoint, key).uncached_tokens(key.tokens)
        endpoint.queued_prefill_tokens += tokens
        try:
            yield
        finally:
            endpoint.queued_prefill_tokens -= tokens

    def view(self, endpoint: Endpoint, key: PromptKey, *, rank: int = 0, home_tokens: float = 0.0) -> EngineView:
        """``endpoint`` as the cost functions see it for ``key`` (``rank``, ``home_tokens``: see EngineView);
        a load read older than ``load_max_age_s`` counts as none, leaving this process's own counts."""
        self._follow_engine(endpoint)
        load = endpoint.load
        is_fresh = load.age_s(self._clock()) <= self._spec.load_max_age_s
        cached = key.matched_tokens(self._index.matched_chunks(endpoint.url, key.hashes))
        running, waiting, kv_usage = without_ended_legs(load, ended=endpoint.legs_ended_since_read) if is_fresh \
            else (0.0, 0.0, 0.0)
        return EngineView(
            url=endpoint.url, running=running, waiting=waiting, kv_usage=kv_usage, in_flight=endpoint.in_flight,
            queued_prefill_tokens=endpoint.queued_prefill_tokens, cached_tokens=cached, home_tokens=home_tokens, rank=rank,
        )

    def _follow_engine(self, endpoint: Endpoint) -> None:
        """Size the engine's index from its reported cache; forget it when its prefix-cache counter
        went back (a restarted engine, or a new one on the same address, starts empty)."""
        load, url = endpoint.load, endpoint.url
        queried = load.prefix_queried_tokens
        if queried < self._queried_tokens.get(url, 0.0):
            self._index.forget(url)
        self._queried_tokens[url] = queried
        if load.kv_capacity_tokens > 0:
            self._index.resize(url, self._capacity_chunks(load.kv_capacity_tokens))

    def _capacity_chunks(self, cache_tokens: float) -> int:
        return max(1, int(cache_tokens * self._share * self._spec.chars_per_token / self._spec.prefix_chunk_chars))


def without_ended_legs(load: EngineLoad, *, ended: int) -> tuple[float, float, float]:
    """(running, waiting, kv_usage) of a load read, less the legs known to have ended since: a read taken
    while a conversation's last turn ran must not count that turn against the engine holding its prefix.
    The KV cache in use shrinks in proportion (a finished request frees its blocks). Pure."""
    requests = load.running + load.waiting
    if ended <= 0 or requests <= 0:
        return load.running, load.waiting, load.kv_usage
    left = max(0.0, requests - ended)
    waiting = min(load.waiting, left)
    return left - waiting, waiting, load.kv_usage * left / requests


@dataclass(frozen=True, slots=True)
class KeyedPolicy:
    """``Router.choose`` for one prompt, in the shape of routing/policy.py's ``Policy``, for the
    orchestrator's failover loop, which asks a policy again for each attempt.

    ``preferred``: the engine already chosen (the decode engine the decision was made for); it is
    chosen while it is a candidate, since asking again could pick another among equal ones.
    """

    router: Router
    key: PromptKey
    preferred: Endpoint | None = None

    def choose(self, candidates: Sequence[Endpoint]) -> Endpoint:
        if self.preferred is not None and any(endpoint is self.preferred for endpoint in candidates):
            return self.preferred
        return self.router.choose(self.key, candidates)

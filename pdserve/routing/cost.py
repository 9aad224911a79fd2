"""The cost of sending one request to each candidate engine, and the cheapest one. Pure.

Decode engine, in requests: its load (requests it holds, those waiting, how full its KV cache
is) less the prompt tokens it already has cached, at ``cached_tokens_per_request`` per request.
Prefill engine, in tokens: the uncached prompt tokens queued on it plus this prompt's own.
Among engines of equal cost, the prompt's home rank decides, the same in every gateway process.
docs/routing.md explains the terms and the knobs (gateway_config.py, RoutingSpec).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from pdserve.gateway_config import RoutingSpec

TIE_TOLERANCE = 1e-6  # costs closer than this are equal: the higher home rank wins


@dataclass(frozen=True, slots=True)
class EngineView:
    """What routing knows of one candidate engine for one request.

    ``running``, ``waiting`` and ``kv_usage`` are the engine's own, as last read (0 when the read
    is too old); ``in_flight`` and ``queued_prefill_tokens`` are this gateway process's, now.
    """

    url: str
    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0  # 0..1
    in_flight: int = 0  # legs this gateway process has open on it
    queued_prefill_tokens: float = 0.0  # uncached prompt tokens of the prefill legs open on it
    cached_tokens: float = 0.0  # of this request's prompt, expected in its prefix cache (this process's index)
    home_tokens: float = 0.0  # of the prompt, held here if it is the prompt's home (prefix.py, prompt_key)
    rank: int = 0  # for this prompt's home (prefix.py, home_rank)

    @property
    def affinity_tokens(self) -> float:
        """What the decode choice weighs as cached: what this process saw routed here, or, at the
        prompt's home, what every process expects there; either way all of them agree."""
        return max(self.cached_tokens, self.home_tokens)

    def uncached_tokens(self, prompt_tokens: float) -> float:
        """Prompt tokens it would still have to compute (or receive) for this request."""
        return max(0.0, prompt_tokens - self.cached_tokens)


def decode_cost(view: EngineView, *, spec: RoutingSpec) -> float:
    """In requests. The engine's count already holds this gateway's requests as of its read; the
    larger of the two is the fresher lower bound of what it carries now."""
    requests = max(view.running + view.waiting, float(view.in_flight))
    load = requests + spec.waiting_weight * view.waiting + spec.kv_usage_weight * view.kv_usage
    return load - view.affinity_tokens / spec.cached_tokens_per_request


def prefill_cost(view: EngineView, *, prompt_tokens: float) -> float:
    """In tokens: the prompt tokens the engine must compute before this prompt's KV is ready."""
    return view.queued_prefill_tokens + view.uncached_tokens(prompt_tokens)


def choose_decode(views: Sequence[EngineView], *, spec: RoutingSpec) -> EngineView:
    """The cheapest decode engine. Engines with a nearly full KV cache (``kv_usage_full``) are
    passed over while any other has room: a request there would preempt running ones.

    Hysteresis: the engine holding most of the prompt's prefix keeps it unless another is cheaper by
    more than the prefix is worth (its cached tokens in requests, at most ``affinity_margin_requests``)
    on top of the recompute that the cost already counts: a reading a request off does not move a
    conversation with a long prefix, and a prompt with little cached has little reason to stay."""
    roomy = [view for view in views if view.kv_usage < spec.kv_usage_full] or list(views)
    best = cheapest(roomy, lambda view: decode_cost(view, spec=spec))
    holder = max(roomy, key=lambda view: (view.affinity_tokens, view.rank))
    if holder.affinity_tokens <= best.affinity_tokens:  # the prefix is no reason to prefer one over the other
        return best
    band = min(spec.affinity_margin_requests, holder.affinity_tokens / spec.cached_tokens_per_request)
    return holder if decode_cost(holder, spec=spec) - decode_cost(best, spec=spec) <= band else best


def choose_prefill(views: Sequence[EngineView], *, prompt_tokens: float) -> EngineView:
    """The prefill engine that would have this prompt's KV ready soonest."""
    return cheapest(views, lambda view: prefill_cost(view, prompt_tokens=prompt_tokens))


def cheapest(views: Sequence[EngineView], cost: Callable[[EngineView], float]) -> EngineView:
    """The view of least ``cost``; among equal ones the highest ranked for this prompt's home, so
    that prompts with nothing to tell engines apart spread over them by their homes, and every
    gateway process sends the same prompt to the same engine.

    Raises ValueError for no views.
    """
    if not views:
        raise ValueError("no engine to choose from")
    costs = [cost(view) for view in views]
    least = min(costs)
    return max((view for view, value in zip(views, costs, strict=True) if value - least <= TIE_TOLERANCE),
               key=lambda view: view.rank)

"""The cost function on scripted engine states: load against expected prefix overlap."""

from __future__ import annotations

import pytest

from pdserve.gateway_config import RoutingSpec
from pdserve.routing.cost import EngineView, cheapest, choose_decode, choose_prefill, decode_cost, prefill_cost

SPEC = RoutingSpec()


def test_decode_cost_counts_requests_waiting_and_kv_usage_in_requests() -> None:
    assert decode_cost(EngineView("d", running=3, waiting=1, kv_usage=0.5), spec=SPEC) == pytest.approx(4 + 1 + 2)
    # the gateway's own count is fresher than the engine's last read
    assert decode_cost(EngineView("d", running=1, in_flight=5), spec=SPEC) == pytest.approx(5)
    assert decode_cost(EngineView("d", cached_tokens=2048), spec=SPEC) == pytest.approx(-2)


def test_a_cached_prefix_outweighs_a_little_more_load() -> None:
    holder = EngineView("holder", running=2, cached_tokens=3000)
    idle = EngineView("idle", running=1)
    assert choose_decode([idle, holder], spec=SPEC).url == "holder"
    swamped = EngineView("holder", running=9, waiting=3, cached_tokens=3000)
    assert choose_decode([idle, swamped], spec=SPEC).url == "idle"


def test_a_decode_engine_with_a_full_kv_cache_is_passed_over_while_another_has_room() -> None:
    full = EngineView("full", kv_usage=0.97, cached_tokens=100_000)
    busy = EngineView("busy", running=20, kv_usage=0.8)
    assert choose_decode([full, busy], spec=SPEC).url == "busy"
    assert choose_decode([full], spec=SPEC).url == "full"  # none has room: still served


def test_among_equal_engines_the_highest_ranked_for_the_prompts_home_wins() -> None:
    views = [EngineView("a", rank=5), EngineView("b", rank=9), EngineView("c", rank=20, running=1, queued_prefill_tokens=10)]
    assert choose_decode(views, spec=SPEC).url == "b"
    assert choose_prefill(views, prompt_tokens=100).url == "b"
    with pytest.raises(ValueError, match="no engine"):
        cheapest([], lambda _view: 0.0)


def test_prefill_engine_by_queued_tokens_and_overlap() -> None:
    queued = EngineView("queued", queued_prefill_tokens=4000)
    cached = EngineView("cached", queued_prefill_tokens=4000, cached_tokens=2500)
    idle = EngineView("idle")
    assert prefill_cost(cached, prompt_tokens=3000) == pytest.approx(4500)
    assert choose_prefill([queued, cached, idle], prompt_tokens=3000).url == "idle"
    assert choose_prefill([queued, cached], prompt_tokens=3000).url == "cached"


def test_a_conversation_stays_on_the_engine_holding_its_prefix_unless_the_other_is_cheaper_by_the_band() -> None:
    """A 750-token prefix weighs 0.73 requests: one request more on its holder would move it without the band."""
    holder = EngineView("holder", running=1, cached_tokens=750)
    idle = EngineView("idle")
    assert decode_cost(holder, spec=SPEC) > decode_cost(idle, spec=SPEC)  # the cost alone would move it
    assert choose_decode([idle, holder], spec=SPEC).url == "holder"
    assert choose_decode([idle, holder], spec=RoutingSpec(affinity_margin_requests=0)).url == "idle"
    busier = EngineView("holder", running=3, cached_tokens=750)  # 2.27 requests dearer: past the band of 0.73
    assert choose_decode([idle, busier], spec=SPEC).url == "idle"


def test_a_short_cached_prompt_moves_to_a_new_idle_engine() -> None:
    """A repeated short prompt (50 tokens, 0.05 requests) on a busy engine: a new engine takes its share."""
    holder = EngineView("holder", running=1, cached_tokens=50)
    assert choose_decode([EngineView("new"), holder], spec=SPEC).url == "new"


def test_engines_holding_the_same_prefix_leave_the_choice_to_the_home() -> None:
    """A system prompt every conversation shares is no reason to pile new conversations on one engine:
    each conversation's home decides, and homes spread (tests/routing/test_router.py)."""
    for home in ("a", "b"):
        views = [EngineView(url, cached_tokens=750, rank=int(url == home),
                            home_tokens=750 if url == home else 0) for url in ("a", "b")]
        assert choose_decode(views, spec=SPEC).url == home


def test_the_home_keeps_a_conversation_no_process_saw_within_the_band() -> None:
    """A gateway process that never saw the conversation expects its history at its home: one
    request more there does not move it, as it would not in the process that routed its turns."""
    home = EngineView("home", running=1, home_tokens=750, rank=1)
    assert choose_decode([EngineView("idle"), home], spec=SPEC).url == "home"
    assert choose_decode([EngineView("idle"), EngineView("home", running=3, home_tokens=750)], spec=SPEC).url == "idle"

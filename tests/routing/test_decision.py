"""PD or local per request, with its reason, on scripted engine states."""

from __future__ import annotations

from pdserve.gateway_config import RoutingSpec
from pdserve.routing.cost import EngineView
from pdserve.routing.decision import Decision, Mode, Reason, decide

SPEC = RoutingSpec(disaggregation="auto", local_max_uncached_tokens=512, prefill_saturated_tokens=16384, prefill_saturated_waiting=4)
IDLE_DECODE = EngineView("d")
IDLE_PREFILL = EngineView("p")


def test_a_short_prompt_is_prefilled_on_its_decode_engine() -> None:
    decision = decide(prompt_tokens=200, decode=IDLE_DECODE, prefill=[IDLE_PREFILL], spec=SPEC)
    assert decision == Decision(Mode.LOCAL, Reason.SHORT_UNCACHED, 200)


def test_a_long_prompt_mostly_cached_on_the_decode_engine_stays_local() -> None:
    holder = EngineView("d", cached_tokens=2900)
    decision = decide(prompt_tokens=3000, decode=holder, prefill=[IDLE_PREFILL], spec=SPEC)
    assert (decision.mode, decision.reason) == (Mode.LOCAL, Reason.SHORT_UNCACHED)
    assert decision.uncached_tokens == 100


def test_a_long_uncached_prompt_is_disaggregated() -> None:
    decision = decide(prompt_tokens=3000, decode=IDLE_DECODE, prefill=[IDLE_PREFILL], spec=SPEC)
    assert (decision.mode, decision.reason) == (Mode.PD, Reason.LONG_UNCACHED)


def test_a_saturated_prefill_pool_sends_long_prompts_to_a_decode_engine_with_room() -> None:
    by_tokens, by_waiting = EngineView("p1", queued_prefill_tokens=20_000), EngineView("p2", waiting=6)
    decision = decide(prompt_tokens=3000, decode=IDLE_DECODE, prefill=[by_tokens, by_waiting], spec=SPEC)
    assert (decision.mode, decision.reason) == (Mode.LOCAL, Reason.PREFILL_SATURATED)
    # one prefill engine with room left: disaggregate
    decision = decide(prompt_tokens=3000, decode=IDLE_DECODE, prefill=[by_tokens, IDLE_PREFILL], spec=SPEC)
    assert decision.mode is Mode.PD
    # a decode engine without room: disaggregate anyway, the prefill queue is the lesser harm
    for crowded in (EngineView("d", waiting=1), EngineView("d", kv_usage=0.8)):
        assert decide(prompt_tokens=3000, decode=crowded, prefill=[by_tokens], spec=SPEC).mode is Mode.PD


def test_no_prefill_engine_means_local() -> None:
    decision = decide(prompt_tokens=3000, decode=IDLE_DECODE, prefill=[], spec=SPEC)
    assert (decision.mode, decision.reason) == (Mode.LOCAL, Reason.NO_PREFILL_ENGINE)


def test_the_header_and_the_configuration_override_the_estimate() -> None:
    assert decide(prompt_tokens=10, decode=IDLE_DECODE, prefill=[IDLE_PREFILL], spec=SPEC,
                  requested=Mode.PD) == Decision(Mode.PD, Reason.REQUESTED, 10)
    always = RoutingSpec(disaggregation="always")
    assert decide(prompt_tokens=10, decode=IDLE_DECODE, prefill=[], spec=always).reason is Reason.CONFIGURED
    never = RoutingSpec(disaggregation="never")
    assert decide(prompt_tokens=9000, decode=IDLE_DECODE, prefill=[IDLE_PREFILL],
                  spec=never) == Decision(Mode.LOCAL, Reason.CONFIGURED, 9000)

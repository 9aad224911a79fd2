"""The router over endpoints with scripted loads: conversations stick to the engine holding their
prefix, distinct prompts spread, short prompts and a saturated prefill pool are served locally."""

from __future__ import annotations

import time
from typing import Any

import pytest

from pdserve.gateway_config import RoutingSpec
from pdserve.role import Role
from pdserve.routing.decision import Mode, Reason
from pdserve.routing.load import EngineLoad
from pdserve.routing.pool import Endpoint, Pool
from pdserve.routing.router import KeyedPolicy, Router, without_ended_legs

NOW_S = 1000.0


def conversation(topic: str, turns: int) -> dict[str, Any]:
    """A chat body with a long system prompt of its own and ``turns`` user turns."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": f"Notes on {topic}. " + "Lorem ipsum dolor. " * 400}]
    for turn in range(turns):
        messages += [{"role": "user", "content": f"Question {turn} about {topic}?"}]
        if turn < turns - 1:
            messages += [{"role": "assistant", "content": f"Answer {turn}."}]
    return {"model": "m", "messages": messages}


def setup(spec: RoutingSpec | None = None) -> tuple[Router, Pool]:
    return Router(spec or RoutingSpec(disaggregation="auto"), clock=lambda: NOW_S), Pool(prefill_urls=["p1", "p2"], decode_urls=["d1", "d2"])


def send(router: Router, pool: Pool, body: dict[str, Any]) -> Endpoint:
    """Choose the decode engine for ``body`` and record it there, as the orchestrator does."""
    key = router.key(body)
    decode = router.choose(key, pool.healthy(Role.DECODE))
    router.record(key, decode)
    return decode


def test_a_conversation_sticks_to_the_engine_that_holds_its_prefix_and_others_spread() -> None:
    router, pool = setup()
    topics = [f"topic {number}" for number in range(24)]
    first = {topic: send(router, pool, conversation(topic, 1)) for topic in topics}
    assert 6 <= sum(engine.url == "d1" for engine in first.values()) <= 18  # homes spread
    for engine in pool.all(Role.DECODE):  # one more request on each, as good as two engines get
        engine.load = EngineLoad(running=1, read_s=NOW_S)
    first["topic 0"].load = EngineLoad(running=2, read_s=NOW_S)  # busier now, yet it holds the conversation
    for turns in (2, 3):
        assert all(send(router, pool, conversation(topic, turns)) is first[topic] for topic in topics)


def test_every_gateway_process_sends_a_conversation_where_its_earlier_turns_went() -> None:
    """Turns reaching processes that never saw the conversation (a load balancer, a new connection
    each) go where the first process sent it, even with the other engine a request lighter."""
    pool = Pool(prefill_urls=["p1"], decode_urls=["d1", "d2"])
    routers = [Router(RoutingSpec(disaggregation="auto"), clock=lambda: NOW_S) for _ in range(4)]
    for topic in [f"topic {number}" for number in range(12)]:
        first = send(routers[0], pool, conversation(topic, 1))
        first.load = EngineLoad(running=1, read_s=NOW_S)  # the other engine is idle
        assert [send(router, pool, conversation(topic, turns)) for turns, router in enumerate(routers[1:], 2)] \
            == [first] * 3
        first.load = EngineLoad(read_s=NOW_S)


def test_the_next_turn_of_a_conversation_is_prefilled_locally_on_its_engine() -> None:
    router, pool = setup()
    key = router.key(conversation("kv caches", 1))
    decode = router.choose(key, pool.healthy(Role.DECODE))
    assert router.decide(key, decode, prefill=pool.healthy(Role.PREFILL)).mode is Mode.PD
    router.record(key, decode)
    key = router.key(conversation("kv caches", 2))
    decision = router.decide(key, decode, prefill=pool.healthy(Role.PREFILL))
    assert (decision.mode, decision.reason) == (Mode.LOCAL, Reason.SHORT_UNCACHED)
    assert decision.uncached_tokens < 100 < key.tokens


def test_a_short_prompt_is_served_locally() -> None:
    router, pool = setup()
    key = router.key({"model": "m", "prompt": "Say hello."})
    decode = router.choose(key, pool.healthy(Role.DECODE))
    decision = router.decide(key, decode, prefill=pool.healthy(Role.PREFILL))
    assert (decision.mode, decision.reason) == (Mode.LOCAL, Reason.SHORT_UNCACHED)


def test_a_saturated_prefill_pool_sends_a_long_prompt_to_the_decode_engine() -> None:
    router, pool = setup()
    for prefill in pool.all(Role.PREFILL):
        prefill.load = EngineLoad(running=8, waiting=12, read_s=NOW_S - 1)
    key = router.key(conversation("attention", 1))
    decode = router.choose(key, pool.healthy(Role.DECODE))
    decision = router.decide(key, decode, prefill=pool.healthy(Role.PREFILL))
    assert (decision.mode, decision.reason) == (Mode.LOCAL, Reason.PREFILL_SATURATED)
    # the same reading, too old to trust: routing falls back to the gateway's own (empty) queues
    for prefill in pool.all(Role.PREFILL):
        prefill.load = EngineLoad(running=8, waiting=12, read_s=NOW_S - 60)
    assert router.decide(key, decode, prefill=pool.healthy(Role.PREFILL)).mode is Mode.PD


def test_prefill_legs_queue_their_uncached_tokens_on_the_engine_while_open() -> None:
    router, pool = setup()
    p1, p2 = pool.all(Role.PREFILL)
    key = router.key(conversation("batching", 1))
    with router.prefilling(key, p1):
        assert p1.queued_prefill_tokens == key.tokens
        assert KeyedPolicy(router, key).choose([p1, p2]) is p2
        assert KeyedPolicy(router, key, preferred=p1).choose([p1, p2]) is p1  # the engine decided for
        assert KeyedPolicy(router, key, preferred=p1).choose([p2]) is p2  # failed over: the cheapest left
    assert p1.queued_prefill_tokens == 0


def test_an_engine_that_restarted_is_forgotten() -> None:
    router, pool = setup()
    body = conversation("restarts", 1)
    decode = send(router, pool, body)
    decode.load = EngineLoad(prefix_queried_tokens=5000, read_s=NOW_S)
    assert router.view(decode, router.key(body)).cached_tokens > 0
    decode.load = EngineLoad(prefix_queried_tokens=10, read_s=NOW_S)  # its counter went back: a new process
    assert router.view(decode, router.key(body)).cached_tokens == 0


def test_the_index_of_an_engine_is_sized_by_its_reported_cache() -> None:
    router, pool = setup(RoutingSpec(disaggregation="auto", prefix_chunk_chars=64, chars_per_token=4.0))
    body = conversation("sizes", 1)
    decode = send(router, pool, body)
    decode.load = EngineLoad(kv_capacity_tokens=64, read_s=NOW_S)  # 4 chunks of 16 tokens
    cached = router.view(decode, router.key(body)).cached_tokens
    assert 0 < cached <= 64


def test_a_load_read_taken_while_a_leg_ran_no_longer_counts_it_once_the_leg_ended() -> None:
    """The engine reported the conversation's previous turn as running; that turn has since ended here."""
    read = EngineLoad(running=2, waiting=1, kv_usage=0.3, read_s=0.0)
    assert without_ended_legs(read, ended=0) == (2, 1, 0.3)
    assert without_ended_legs(read, ended=1) == (1, 1, pytest.approx(0.2))
    assert without_ended_legs(read, ended=5) == (0, 0, 0)
    pool = Pool(decode_urls=["http://d"])
    (endpoint,) = pool.all(Role.DECODE)
    endpoint.take_load(EngineLoad(running=1, kv_usage=0.1, read_s=time.monotonic()))
    with pool.in_flight(endpoint):
        assert endpoint.legs_ended_since_read == 0
    assert endpoint.legs_ended_since_read == 1
    view = Router(RoutingSpec()).view(endpoint, Router(RoutingSpec()).key({"prompt": "x" * 300}))
    assert (view.running, view.kv_usage) == (0, 0)
    endpoint.take_load(EngineLoad(running=1, read_s=time.monotonic()))  # a new read: it knows by itself
    assert endpoint.legs_ended_since_read == 0

"""The prefix estimate: chained chunk hashes of a canonical prompt text, and a bounded LRU per engine."""

from __future__ import annotations

from typing import Any

import pytest

from pdserve.routing.prefix import PrefixIndex, chunk_hashes, home_rank, prompt_key, prompt_text

SYSTEM = {"role": "system", "content": "You are a careful assistant. " * 20}


def test_a_chunk_hash_stands_for_the_whole_prefix_up_to_it() -> None:
    first, second = chunk_hashes("a" * 8 + "b" * 8, chunk_chars=8), chunk_hashes("c" * 8 + "b" * 8, chunk_chars=8)
    assert len(first) == 2 and first[1] != second[1]  # the same second chunk after a different first one
    assert chunk_hashes("a" * 8 + "b" * 8 + "xyz", chunk_chars=8) == first  # a partial tail is not cached
    assert chunk_hashes("short", chunk_chars=8) == ()


def test_a_conversations_next_turn_starts_with_the_text_of_the_turns_before() -> None:
    turn_1 = [SYSTEM, {"role": "user", "content": "What is a KV cache?"}]
    turn_2 = [*turn_1, {"role": "assistant", "content": "It keeps keys and values."},
              {"role": "user", "content": [{"type": "text", "text": "And prefix caching?"}]}]
    assert prompt_text({"messages": turn_2}).startswith(prompt_text({"messages": turn_1}))
    assert prompt_text({"messages": turn_1, "tools": [{"type": "function"}]}) != prompt_text({"messages": turn_1})


def test_every_turn_of_a_conversation_has_its_home_and_expects_its_earlier_turns_there() -> None:
    def key(*turns: str) -> Any:
        messages: list[dict[str, str]] = [SYSTEM]
        for turn in turns:
            messages += [{"role": "user", "content": turn}, {"role": "assistant", "content": "Noted."}]
        return prompt_key({"messages": messages[:-1]}, chunk_chars=16, chars_per_token=4.0, home_key_chars=64)

    first, third, other = key("What is a KV cache?"), key("What is a KV cache?", "Why?", "How big?"), key("Hi")
    assert first.home == third.home != other.home  # the same opening, in any process (a stable digest)
    assert third.home_tokens == pytest.approx(third.tokens * (third.chars - len("<|user|>How big?<|end|>\n"))
                                              / third.chars)  # all but the new user message
    assert first.home_tokens == pytest.approx(len(prompt_text({"messages": [SYSTEM]})) / 4.0)
    ranks = {url: home_rank(first.home, url) for url in ("http://a:1", "http://b:1", "http://c:1")}
    assert len(set(ranks.values())) == 3 and ranks == {url: home_rank(first.home, url) for url in ranks}
    long_prompt = prompt_key({"prompt": "x" * 100 + "tail"}, chunk_chars=16, chars_per_token=4.0, home_key_chars=64)
    assert long_prompt.home == prompt_key({"prompt": "x" * 100}, chunk_chars=16, chars_per_token=4.0,
                                          home_key_chars=64).home and long_prompt.home_tokens == 16.0


def test_completion_prompts_as_text_a_list_of_one_or_token_ids() -> None:
    assert prompt_text({"prompt": "hello"}) == prompt_text({"prompt": ["hello"]}) == "hello"
    key = prompt_key({"prompt": list(range(100))}, chunk_chars=16, chars_per_token=4.0, home_key_chars=64)
    assert key.tokens == 100  # token ids are counted, not estimated
    text_key = prompt_key({"prompt": "x" * 400}, chunk_chars=16, chars_per_token=4.0, home_key_chars=64)
    assert text_key.tokens == 100 and len(text_key.hashes) == 25
    assert text_key.matched_tokens(5) == pytest.approx(20.0)
    assert text_key.matched_tokens(99) == 100.0


def test_index_matches_the_leading_chunks_an_engine_holds() -> None:
    index = PrefixIndex(default_capacity_chunks=100)
    routed = chunk_hashes("p" * 64, chunk_chars=16)
    index.insert("d1", routed)
    longer = chunk_hashes("p" * 64 + "q" * 32, chunk_chars=16)
    assert index.matched_chunks("d1", longer) == 4
    assert index.matched_chunks("d2", longer) == 0
    assert index.matched_chunks("d1", chunk_hashes("z" + "p" * 63, chunk_chars=16)) == 0


def test_a_full_index_forgets_the_least_recently_routed_and_prefixes_last() -> None:
    index = PrefixIndex(default_capacity_chunks=4)
    old, new = chunk_hashes("o" * 48, chunk_chars=16), chunk_hashes("n" * 32, chunk_chars=16)
    index.insert("d1", old)
    index.insert("d1", new)
    assert index.size("d1") == 4
    assert index.matched_chunks("d1", new) == 2
    assert index.matched_chunks("d1", old) == 2  # its tail went first, as vLLM frees a request's blocks
    index.resize("d1", 2)
    assert index.matched_chunks("d1", old) == 0 and index.matched_chunks("d1", new) == 2
    index.forget("d1")
    assert index.matched_chunks("d1", new) == 0

"""Workloads: exact output lengths, shared prefixes, trace replay, Poisson arrivals."""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path

import pytest

from pdserve.bench.prompts import WordPrompts
from pdserve.bench.workload import (
    CHAT,
    BenchRequest,
    Lengths,
    poisson_arrivals,
    replay_trace,
    shared_prefix_chat,
    synthetic,
)
from pdserve.errors import ConfigError


def test_lengths_parse_fixed_and_ranges_and_reject_nonsense() -> None:
    assert Lengths.parse("128", name="x") == Lengths(128, 128)
    assert Lengths.parse("64-256", name="x") == Lengths(64, 256)
    for bad in ("0", "9-3", "many"):
        with pytest.raises(ConfigError, match="x"):
            Lengths.parse(bad, name="x")


def test_synthetic_requests_ask_for_exact_streamed_output() -> None:
    requests = synthetic(5, model="m", input_tokens=Lengths(20, 20), output_tokens=Lengths(7, 7),
                         prompts=WordPrompts(), seed=0)
    for request in requests:
        body = request.body
        assert body["max_tokens"] == 7 and body["ignore_eos"] is True and body["stream"] is True
        assert body["stream_options"] == {"include_usage": True}
        assert len(body["prompt"].split()) == 20
    assert len({request.body["prompt"] for request in requests}) == 5  # no accidental prefix cache hits


def test_same_seed_gives_every_target_the_same_requests() -> None:
    def make() -> list[BenchRequest]:
        return synthetic(3, model="m", input_tokens=Lengths(5, 50), output_tokens=Lengths(1, 9),
                         prompts=WordPrompts(), seed=4)

    assert make() == make()


def test_a_salt_changes_the_text_but_not_the_lengths() -> None:
    """Each target gets its own text, so one engine's prefix cache cannot serve another target's run."""
    def make(salt: int) -> list[BenchRequest]:
        return synthetic(8, model="m", input_tokens=Lengths(5, 50), output_tokens=Lengths(1, 9),
                         prompts=WordPrompts(), seed=4, salt=salt)

    first, second = make(0), make(1)
    assert [len(r.body["prompt"].split()) for r in first] == [len(r.body["prompt"].split()) for r in second]
    assert [r.body["max_tokens"] for r in first] == [r.body["max_tokens"] for r in second]
    assert not {r.body["prompt"] for r in first} & {r.body["prompt"] for r in second}
    chats = [shared_prefix_chat(4, model="m", prefix_tokens=30, turn_tokens=Lengths(5, 5), output_tokens=Lengths(4, 4),
                                turns=2, prompts=WordPrompts(), seed=0, salt=salt) for salt in (0, 1)]
    assert chats[0][0].body["messages"][0] != chats[1][0].body["messages"][0]  # its own system prompt


def test_chat_conversations_share_the_system_prompt_and_grow_turn_by_turn() -> None:
    requests = shared_prefix_chat(6, model="m", prefix_tokens=30, turn_tokens=Lengths(5, 5),
                                  output_tokens=Lengths(4, 4), turns=3, prompts=WordPrompts(), seed=0)
    assert len(requests) == 6 and all(request.path == CHAT for request in requests)
    systems = {request.body["messages"][0]["content"] for request in requests}
    assert len(systems) == 1
    first_turn, second_turn = requests[0].body["messages"], requests[2].body["messages"]  # 2 conversations
    assert second_turn[: len(first_turn)] == first_turn and len(second_turn) == len(first_turn) + 2


def test_trace_replay_reads_prompts_lengths_and_timestamps(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 0.0, "input_tokens": 12, "output_tokens": 3},
             {"timestamp": 0.5, "prompt": "hello", "output_tokens": 2},
             {"timestamp": 1.0, "messages": [{"role": "user", "content": "hi"}], "output_tokens": 1}]
    trace.write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    requests = replay_trace(trace, model="m", prompts=WordPrompts(), seed=0)
    assert [request.at_s for request in requests] == [0.0, 0.5, 1.0]
    assert len(requests[0].body["prompt"].split()) == 12 and requests[1].body["prompt"] == "hello"
    assert requests[2].path == CHAT and requests[2].body["max_tokens"] == 1


def test_trace_replay_names_the_bad_line(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text('{"output_tokens": 1, "prompt": "ok"}\n{"prompt": "no length"}\n')
    with pytest.raises(ConfigError, match=":2:"):
        replay_trace(trace, model="m", prompts=WordPrompts(), seed=0)


def test_poisson_arrivals_have_the_asked_mean_rate() -> None:
    offsets = poisson_arrivals(4000, rate=8.0, seed=1)
    gaps = [later - earlier for earlier, later in itertools.pairwise(offsets)]
    assert offsets[0] == 0.0 and all(gap >= 0 for gap in gaps)
    assert statistics.mean(gaps) == pytest.approx(1 / 8.0, rel=0.05)
    assert poisson_arrivals(10, rate=8.0, seed=1) == offsets[:10]  # seeded: reproducible

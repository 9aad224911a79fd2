"""Property-based: no request, however malformed or large, gets a 5xx, a crash or a hang from the
gateway; every refusal is OpenAI error JSON with a 4xx status, what reaches an engine is clean
JSON, and the gateway serves normally afterwards. Real gateway over HTTP, fake engines."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pdserve.gateway.app import build_app
from pdserve.protocol import MAX_NESTING, ChatRequest, CompletionRequest
from tests.conftest import free_port, serving
from tests.fake_engine import FakeEngine
from tests.gateway.test_app import MODEL, gateway_settings, until_ready

MAX_BODY_BYTES = 64 * 1024
REFUSALS = {400, 401, 404, 405, 413, 431}
PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


class Gateway:
    def __init__(self, base: str, engine: FakeEngine, engine_url: str, session: aiohttp.ClientSession) -> None:
        self.base, self.engine, self.engine_url, self.session = base, engine, engine_url, session

    async def post(self, path: str, data: bytes, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
        async with self.session.post(self.base + path, data=data, headers=headers) as reply:
            return reply.status, await reply.read()


@pytest.fixture(scope="module")
async def gateway() -> AsyncIterator[Gateway]:
    fake = FakeEngine()
    async with serving(fake.app(), free_port()) as url:
        spec = gateway_settings(prefill=[url], decode=[url], max_body_bytes=MAX_BODY_BYTES, max_header_bytes=8192)
        async with serving(build_app(spec), spec.gateway.port) as base:
            await until_ready(base)
            timeout = aiohttp.ClientTimeout(total=10)  # a hang fails the test rather than stalling it
            async with aiohttp.ClientSession(timeout=timeout) as session:
                yield Gateway(base, fake, url, session)


def assert_answered_properly(gateway: Gateway, status: int, payload: bytes) -> None:
    """A 200, or a 4xx refusal as an OpenAI error that names none of our hosts; engines got clean JSON."""
    assert status == 200 or status in REFUSALS, (status, payload[:300])
    if status != 200:
        error = json.loads(payload)["error"]
        assert set(error) == {"message", "type", "param", "code"} and isinstance(error["message"], str)
        assert error["type"] == "invalid_request_error"
    assert gateway.engine_url.removeprefix("http://") not in payload.decode(errors="replace")
    for body in gateway.engine.bodies:
        assert depth(body) <= MAX_NESTING + 2  # and below: it encodes as strict UTF-8 JSON
        json.dumps(body, allow_nan=False).encode("utf-8")
    gateway.engine.bodies.clear()


def depth(value: Any) -> int:
    if isinstance(value, dict):
        return 1 + max(map(depth, value.values()), default=0)
    if isinstance(value, list):
        return 1 + max(map(depth, value), default=0)
    return 0


async def assert_still_serving(gateway: Gateway) -> None:
    status, payload = await gateway.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "ok?"}).encode())
    assert status == 200, payload
    gateway.engine.bodies.clear()


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)
FIELDS = sorted((set(ChatRequest.model_fields) | set(CompletionRequest.model_fields)) - {"model"})
request_bodies = st.fixed_dictionaries(
    {"model": st.just(MODEL) | json_values},
    optional={name: json_values for name in FIELDS} | {"prompt": st.text(max_size=50) | st.lists(st.integers())},
)
# Header names are HTTP tokens: anything else is not HTTP, and the server (uvicorn) refuses it itself.
TOKEN_CHARS = st.sampled_from("!#$%&'*+-.^_`|~0123456789abcdefghijklmnopqrstuvwxyz")
hex_digit = st.sampled_from("0123456789abcdefABCDEF")
# Fragments the fuzzer used: extreme numbers, deep nesting, \u escapes (lone surrogates among them), bare literals.
hostile_fragments = st.one_of(
    st.integers(1, 6000).map(lambda digits: "9" * digits),
    st.sampled_from(["1e999", "-1e999", "1e-999", "NaN", "Infinity", "-Infinity", "-0", "0.0000000001e-400"]),
    st.integers(1, 3000).map(lambda levels: "[" * levels + "]" * levels),
    st.integers(1, 3000).map(lambda levels: '{"a":' * levels + "1" + "}" * levels),
    st.lists(hex_digit, min_size=4, max_size=4).map(lambda digits: '"\\u' + "".join(digits) + '"'),
    st.sampled_from(['"\\ud800"', '"\\udfff\\ud800"', '"\\ud83d\\ude00"', '"\\u0000"', '"\\uFFFF"', '"\\uD834"']),
)


@PROPERTY
@given(body=request_bodies, path=st.sampled_from(["/v1/completions", "/v1/chat/completions"]))
async def test_any_request_shaped_body_gets_200_or_a_4xx_openai_error(gateway: Gateway, body: dict[str, Any],
                                                                       path: str) -> None:
    status, payload = await gateway.post(path, json.dumps(body).encode())
    assert_answered_properly(gateway, status, payload)


@PROPERTY
@given(fragment=hostile_fragments, field=st.sampled_from(["seed", "max_tokens", "prompt", "model", "top_k", "user",
                                                          "logit_bias", "stop", "chat_template_kwargs", "\\ud800"]))
async def test_hostile_json_in_any_field_is_refused_or_served_never_a_5xx(gateway: Gateway, fragment: str,
                                                                          field: str) -> None:
    raw = f'{{"model": "{MODEL}", "prompt": "hi", "messages": [{{"role": "user", "content": "hi"}}], "{field}": {fragment}}}'
    for path in ("/v1/completions", "/v1/chat/completions"):
        status, payload = await gateway.post(path, raw.encode())
        assert_answered_properly(gateway, status, payload)
    await assert_still_serving(gateway)


@PROPERTY
@given(raw=st.binary(max_size=2048) | st.text(max_size=512).map(str.encode) | hostile_fragments.map(str.encode))
async def test_arbitrary_bytes_are_refused_as_openai_errors(gateway: Gateway, raw: bytes) -> None:
    status, payload = await gateway.post("/v1/completions", raw)
    assert_answered_properly(gateway, status, payload)


@PROPERTY
@given(size=st.integers(0, 4 * MAX_BODY_BYTES), is_chunked=st.booleans())
async def test_bodies_over_the_limit_are_413_whether_declared_or_streamed(gateway: Gateway, size: int,
                                                                         is_chunked: bool) -> None:
    body = json.dumps({"model": MODEL, "prompt": "x" * size}).encode()

    async def chunks() -> AsyncIterator[bytes]:
        for start in range(0, len(body), 8192):
            yield body[start:start + 8192]

    async with gateway.session.post(gateway.base + "/v1/completions", data=chunks() if is_chunked else body) as reply:
        status, payload = reply.status, await reply.read()
    assert status == (413 if len(body) > MAX_BODY_BYTES else 200)
    assert_answered_properly(gateway, status, payload)


@PROPERTY
@given(name=st.text(TOKEN_CHARS, min_size=1, max_size=40), size=st.integers(1, 20_000))
async def test_oversized_headers_are_431_and_odd_ones_never_a_5xx(gateway: Gateway, name: str, size: int) -> None:
    headers = {f"x-{name}": "v" * size}
    status, payload = await gateway.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi"}).encode(),
                                         headers=headers)
    if size > 8192:
        assert status == 431
    assert_answered_properly(gateway, status, payload)


@pytest.mark.parametrize("raw", [
    b'{"model": "pdserve-demo", "prompt": "hi", "seed": ' + b"9" * 5000 + b"}",  # past Python's int-digit limit
    b'{"model": "pdserve-demo", "prompt": "hi", "x": ' + b"[" * 20_000 + b"]" * 20_000 + b"}",  # recursion
    b'{"model": "pdserve-demo", "prompt": "\\ud800"}',  # lone surrogate the engine's tokenizer cannot encode
    b'{"model": "pdserve-demo", "prompt": "hi", "\\udfff": 1}',  # in a key: pydantic had no field to name
    b'{"model": "pdserve-demo", "prompt": "\xed\xa0\x80"}',  # the same surrogate as raw (invalid) UTF-8
    b'{"model": "pdserve-demo", "prompt": "hi", "logit_bias": {"1": NaN}}',  # not JSON, and would be forwarded
    b'{"model": "pdserve-demo", "prompt": "hi", "seed": 1208925819614629174706176}',  # 2**80 overflows an engine
    b'{"model": "pdserve-demo", "prompt": [4294967296]}',  # token id past 32 bits
])
async def test_inputs_the_fuzzer_found_are_400_openai_errors(gateway: Gateway, raw: bytes) -> None:
    status, payload = await gateway.post("/v1/completions", raw)
    assert status == 400, payload
    assert_answered_properly(gateway, status, payload)
    await assert_still_serving(gateway)


async def test_a_client_cannot_steer_a_leg_to_another_engine_or_host(gateway: Gateway) -> None:
    steering = {"kv_transfer_params": {"remote_host": "169.254.169.254", "remote_port": 80, "do_remote_prefill": True}}
    status, payload = await gateway.post("/v1/completions", json.dumps({"model": MODEL, "prompt": "hi", **steering}).encode(),
                                         headers={"Host": "evil.example", "X-Forwarded-Host": "evil.example"})
    assert status == 400 and json.loads(payload)["error"]["param"] == "kv_transfer_params"
    assert gateway.engine.bodies == []
